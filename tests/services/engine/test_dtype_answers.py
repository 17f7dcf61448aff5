"""The README's first question answered right in every dtype `--dtype auto` may pick here.

Its first answer token is a near tie in the embedded model ("The" 25.33 against "L" 25.24 in
float32): with bfloat16 logits (0.125 apart there) or a bfloat16 residual stream, the answer
became "L'Étoile, la Marseillaise...". pdserve keeps the residual stream and the logits in
float32 (families/llama/model.py, kernels/bf16_linear.c)."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import load_model
from tests.support.dtypes import COMPUTE_DTYPES

QUESTION = "What is the capital of France?"


@pytest.mark.parametrize("dtype", [*COMPUTE_DTYPES, "auto"])
def test_the_readme_question_is_answered_in_every_dtype(dtype):
    loaded = load_model("embedded", dtype, "cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=32))
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    assert output.choices[0].text == "The capital of France is Paris."
