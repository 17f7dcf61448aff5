"""What the sections share: the run's settings and sizes, and the models each loads once."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.offline import log
from services.model.loader import DTYPES, LoadedModel, load_model
from services.settings import DEFAULTS

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [  # tests/services/model/test_reference.py's
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time in 1999,",
    "The three primary colors are",
    "Translate to French: I would like a cup of coffee.",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Les montagnes des Alpes sont",
    "import numpy as np\nx = np.arange(10)\nprint(",
]
BLOCK = 16  # the engine's KV block size, for sizing its pool


@dataclass(frozen=True)
class Sizes:
    kernel_tests: str  # pytest -k expression choosing the Triton tests; "": all of them
    parity_prompts: int  # the first of PROMPTS
    parity_tokens: int  # greedy tokens per prompt
    decode_batches: tuple[int, ...]  # the engine's decode, sequences at once
    hf_batches: tuple[int, ...]  # transformers' decode
    decode_prompt_len: int  # tokens of each decoding sequence's prompt
    warm_steps: int  # untimed decode steps before the timed ones
    decode_steps: int  # timed decode steps at each batch
    prefill_len: int  # tokens of the one prompt whose prefill is timed
    served_prompts: int  # prompts sent to `pdserve up`, each streamed and not
    served_tokens: int  # tokens each
    realistic_batches: tuple[int, ...]  # the realistic sizes' decode (realistic.py)


FULL = Sizes(
    kernel_tests="",
    parity_prompts=8,
    parity_tokens=64,
    decode_batches=(1, 32, 256),
    hf_batches=(1, 32, 256),
    decode_prompt_len=32,
    warm_steps=4,
    decode_steps=64,
    prefill_len=4096,
    served_prompts=4,
    served_tokens=32,
    realistic_batches=(1, 64),
)
DRY = Sizes(  # the CPU suite's: every section end to end, each as small as it goes
    # one test a file: the suite runs them all (TRITON_INTERPRET=1) elsewhere
    kernel_tests="float32 and (views_are_read_and_written or decode_rows_alone)",
    parity_prompts=2,
    parity_tokens=8,
    decode_batches=(1, 4),
    hf_batches=(1,),
    decode_prompt_len=16,
    warm_steps=1,
    decode_steps=2,
    prefill_len=32,
    served_prompts=1,
    served_tokens=8,
    realistic_batches=(1, 4),
)


class Skip(Exception):
    """A section (or part of one) that cannot run here; the message says why."""


@dataclass
class Check:
    """One run's settings and what its sections share: models loaded once each."""

    device: torch.device
    sizes: Sizes
    dry: bool
    deadline: float  # time.monotonic() after which no section starts
    out: Path
    # (dtype, kernels, deterministic)
    models: dict[tuple[str, str, bool], LoadedModel] = field(default_factory=dict)
    references: dict[str, Any] = field(default_factory=dict)  # transformers' models by dtype

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def model(
        self, dtype: str, kernels: str = DEFAULTS.model.kernels, deterministic: bool = True
    ) -> LoadedModel:
        key = (dtype, kernels, deterministic)
        if key not in self.models:
            log(
                f"  loading the embedded model: {dtype}, kernels {kernels}, "
                f"deterministic {deterministic}"
            )
            self.models[key] = load_model(
                "embedded", dtype, str(self.device), kernels=kernels, deterministic=deterministic
            )
        return self.models[key]

    def reference(self, dtype: str) -> Any:
        if dtype not in self.references:
            import transformers

            log(f"  loading transformers' model: {dtype}")
            path = self.model(dtype).path
            hf: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
            self.references[dtype] = hf.to(self.device).eval()
        return self.references[dtype]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        """What was deleted, returned to the device (the next model may need it all)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
