"""Section 2: the engine's greedy tokens against transformers' `generate(do_sample=False)`."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.gpu_check.check import BLOCK, PROMPTS, Check
from bench.offline import log
from services.engine.engine import Engine, EngineConfig
from services.engine.outputs import Choice
from services.engine.params import SamplingParams
from services.model.kernels import gpu
from services.model.loader import LoadedModel, cpu_has_bf16_units

BF16_PREFIX = 16  # bfloat16 must match on this many first tokens (or all, when fewer)
TRITON_TOKENS = 2  # the dry run's Triton forwards: one prefill, one decode


def engine_generate(loaded: LoadedModel, prompts: list[list[int]], tokens: int) -> list[Choice]:
    """Greedy, every prompt in one batch."""
    blocks = sum(math.ceil((len(p) + tokens) / BLOCK) + 1 for p in prompts) + 8
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=blocks))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [out.choices[0] for out in engine.generate(prompts, params)]


def hf_greedy(check: Check, dtype: str, prompt: list[int], tokens: int) -> list[int]:
    return hf_generate(check.reference(dtype), prompt, tokens, check.device)


def hf_generate(model: Any, prompt: list[int], tokens: int, device: torch.device) -> list[int]:
    """transformers' greedy tokens for one prompt, on `device`."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.to(device).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def compare(check: Check, dtype: str) -> dict[str, Any]:
    """Both sides' greedy tokens for the first prompts: where each pair first differs."""
    n, tokens = check.sizes.parity_prompts, check.sizes.parity_tokens
    loaded = check.model(dtype)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:n]]
    log(f"  {dtype}: the engine, {n} prompts x {tokens} tokens")
    start = time.perf_counter()
    ours = [c.token_ids for c in engine_generate(loaded, prompts, tokens)]
    middle = time.perf_counter()
    log(f"  {dtype}: transformers")
    theirs = [hf_greedy(check, dtype, p, tokens) for p in prompts]
    divergence = [first_divergence(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {"prompts": n, "tokens": tokens, "first_divergence": divergence,
            "identical": divergence.count(None), "engine_s": middle - start,
            "transformers_s": time.perf_counter() - middle, "engine_first": ours[0]}  # fmt: skip


def run(check: Check, numbers: dict[str, Any]) -> bool:
    f32 = numbers["float32"] = compare(check, "float32")
    passed = f32["identical"] == f32["prompts"]
    if check.device.type == "cpu" and not cpu_has_bf16_units():  # torch would emulate bf16
        numbers["bfloat16"] = {"skip": "no bf16 units"}
    else:
        b16 = numbers["bfloat16"] = compare(check, "bfloat16")
        prefix = min(BF16_PREFIX, b16["tokens"])
        matched = sum(d is None or d >= prefix for d in b16["first_divergence"])
        # a dry run's prompts are too few and short to judge: bfloat16 on a CPU rounds
        # differently from transformers' kernels and 8 tokens can cross a near tie
        b16 |= {
            "matched_first_tokens": {"tokens": prefix, "prompts": matched},
            "judged": not check.dry,
        }
        if b16["judged"]:
            passed = passed and 2 * matched > b16["prompts"]
    if check.dry:
        passed = triton_forward(check, numbers) and passed
    return passed


def triton_forward(check: Check, numbers: dict[str, Any]) -> bool:
    """One prompt's first greedy tokens through the Triton kernels (interpreted on a CPU)."""
    if check.device.type == "cpu" and not gpu.interpreted():
        numbers["triton"] = {"skip": "TRITON_INTERPRET is not set"}
        return True
    loaded = check.model("float32", "triton")
    start = time.perf_counter()
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    got = engine_generate(loaded, [prompt], TRITON_TOKENS)[0].token_ids
    expected = numbers["float32"]["engine_first"][:TRITON_TOKENS]
    numbers["triton"] = {"tokens": got, "expected": expected, "identical": got == expected,
                         "seconds": time.perf_counter() - start}  # fmt: skip
    del check.models["float32", "triton", True]
    return got == expected


def summary(n: dict[str, Any]) -> str:
    f32, b16 = n["float32"], n["bfloat16"]
    line = f"float32 {f32['identical']}/{f32['prompts']} identical; bfloat16 "
    if "skip" in b16:
        line += f"skip: {b16['skip']}"
    else:
        m = b16["matched_first_tokens"]
        line += (
            f"{b16['identical']}/{b16['prompts']} identical, {m['prompts']} on the first "
            f"{m['tokens']} tokens (first divergence {b16['first_divergence']})"
        )
        line += "" if b16["judged"] else ", recorded, not judged (dry)"
    if t := n.get("triton"):
        if "skip" in t:
            line += f"; triton skip: {t['skip']}"
        else:
            outcome = "identical" if t["identical"] else f"{t['tokens']} against {t['expected']}"
            line += f"; triton {TRITON_TOKENS} tokens {outcome}"
    return line
