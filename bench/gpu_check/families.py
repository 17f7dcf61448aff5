"""Section 5: the MoE and latent-attention families on the device, against transformers there.

Each family of tests/support/tiny_models.py (random checkpoints made by the transformers in use,
saved under DIR/families and removed after) is loaded in float32 and run greedily by the
engine, every prompt in one batch; transformers' `generate(do_sample=False)` runs each prompt
alone on the same device. Then DeepSeek-V3's and V4's own MTP layers draft (`--speculative mtp`, a
checkpoint whose MTP layer repeats its one layer): the tokens must equal the plain engine's.
Pass: every family that transformers builds identical, and the MTP run identical with drafts
accepted. A family transformers does not have (an older version) is recorded as missing.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch

from bench.gpu_check.check import Check
from bench.gpu_check.parity import first_divergence, hf_generate
from bench.offline import log
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import load_model, load_mtp
from services.model.loading.sources import EMBEDDED, resolve
from services.settings import SpeculativeConfig

PROMPT_LENGTHS = (40, 17, 5)


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def engine_tokens(
    loaded: Any,
    batch: list[list[int]],
    tokens: int,
    draft: Any = None,
    spec: SpeculativeConfig | None = None,
) -> tuple[list[list[int]], Any]:
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(num_blocks=64, speculative=spec or SpeculativeConfig()),
        draft=draft,
    )
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out = [o.choices[0].token_ids for o in engine.generate(batch, params)]
    return out, engine.speculator.stats if engine.speculator is not None else None


def run(check: Check, numbers: dict[str, Any]) -> bool:
    from tests.support import tiny_models as tiny

    tokens = 8 if check.dry else 24
    names = ["deepseek_v3"] if check.dry else sorted(tiny.FAMILIES)
    root, embedded = check.out / "families", resolve(EMBEDDED)
    batch = prompts(tiny.VOCAB)
    results: dict[str, Any] = {}
    try:
        for name in names:
            log(f"  {name}")
            try:
                reference = tiny.save_tiny(name, root / name, embedded)
            except (AttributeError, ValueError, KeyError) as e:  # not in this transformers
                results[name] = {"missing": f"{type(e).__name__}: {e}"}
                continue
            try:
                loaded = load_model(str(root / name), "float32", str(check.device))
                ours, _ = engine_tokens(loaded, batch, tokens)
                theirs = [hf_generate(reference, p, tokens, check.device) for p in batch]
            except Exception as e:  # recorded; the next family runs
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            results[name] = {
                "first_divergence": [
                    first_divergence(a, b) for a, b in zip(ours, theirs, strict=True)
                ]
            }
        numbers["mtp"] = {}
        for name, save in (
            ("deepseek_v3", tiny.save_tiny_mtp),
            ("deepseek_v4", tiny.save_tiny_v4_mtp),
        ):
            log(f"  {name} with its MTP layer (a copy of its one layer)")
            save(root / f"mtp-{name}", embedded, copy=True)
            loaded = load_model(str(root / f"mtp-{name}"), "float32", str(check.device))
            m = loaded.model
            draft = load_mtp(loaded.path, loaded.config, m.dtype, m.device, m.kernels)
            plain, _ = engine_tokens(loaded, batch, tokens)
            spec = SpeculativeConfig("mtp", num_tokens=3)
            drafted, stats = engine_tokens(loaded, batch, tokens, draft, spec)
            numbers["mtp"][name] = {"equal": drafted == plain, "proposed": stats.proposed,
                                    "accepted": stats.accepted}  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    numbers["families"] = results
    ran = [r for r in results.values() if "first_divergence" in r]
    identical = all(d is None for r in ran for d in r["first_divergence"])
    identical &= not any("error" in r for r in results.values())
    drafts = numbers["mtp"].values()
    return bool(ran) and identical and all(m["equal"] and m["accepted"] > 0 for m in drafts)


def summary(n: dict[str, Any]) -> str:
    fams = n["families"]
    same = [k for k, r in fams.items() if all(d is None for d in r.get("first_divergence", [0]))]
    differ = {
        k: r["first_divergence"]
        for k, r in fams.items()
        if "first_divergence" in r and k not in same
    }
    missing = [k for k, r in fams.items() if "missing" in r]
    errors = {k: r["error"] for k, r in fams.items() if "error" in r}
    drafts = ", ".join(
        f"{k} tokens {'equal' if m['equal'] else 'DIFFER'}, "
        f"{m['accepted']}/{m['proposed']} accepted"
        for k, m in n["mtp"].items()
    )
    return (
        f"float32 identical: {', '.join(same) or 'none'}; differ: {differ or 'none'}; "
        f"not in this transformers: {', '.join(missing) or 'none'}; failed: {errors or 'none'}; "
        f"MTP drafts: {drafts}"
    )
