"""`pdserve up --tensor-parallel 3` on the embedded model: the worker split over three
processes (its 3 KV heads one each) answers as one process does, token for token with the
same logprobs, through the router and the official client. (A tensor rank killed mid-stream:
tests/decode/test_data_parallel_e2e.py's grid case.)"""

from __future__ import annotations

import openai

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import free_port
from tests.support.up import Up

PROMPT = "The lighthouse keeper climbed the stairs and"
NAME = "SmolLM2-135M-Instruct"


def test_split_workers_answer_as_one_process(embedded):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=128))
    (expected,) = engine.generate([PROMPT], params)
    out = Up("--port", str(free_port()), "--kv-store", "memory://", "--num-blocks", "128",
             "--dtype", "float32", "--tensor-parallel", "3")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
        args = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
        choice = client.completions.create(**args).choices[0]
        assert choice.text == expected.choices[0].text
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        want = [lp.logprob for lp in expected.choices[0].logprobs]
        assert choice.logprobs.token_logprobs == want

    finally:
        out.stop()
