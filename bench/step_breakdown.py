"""Where a decode step of a DeepSeek-V3-shaped MoE goes, part by part, at several batch sizes.

    python -m bench.step_breakdown [--dtype auto] [--batches 1,8,32] [--steps 16] [--json F]

The model: a random DeepSeek-V3 checkpoint (MLA with DeepSeek's latent width 512 + 64, 24
routed experts of which 6 per token plus a shared one, sigmoid routing with noaux_tc,
~280M parameters: `SHAPE`), made once with transformers. The engine decodes `batch` requests
with `--context`-token prompts; after a warm-up, each part of `--steps` steps is timed by
wrapping the function that does it (exclusive times: a part's own time, its callees' taken
out, so the rows sum to the step):

  MLA projections      q/kv down and up products, their norms, rotary (project)
  absorption products  q_nope into the latent space and the attended latent out (heads_matmul)
  MLA attention        the absorbed attention kernel over the paged latents
  attention output     o_proj
  dense MLPs           the first layer's dense MLP and every layer's shared expert
  routing              router product, scores, group-limited top-k
  expert products      the routed experts' gate/up, SiLU, down
  expert dispatch      sort by expert, gather, scatter back, weighted sum
  norms and residual   add + RMS norm
  logits               the output head
  forward, rest        embedding, plans, cache writes, the rest of the forward pass
  sampling             logits to tokens
  serving loop         scheduling, batch building, stop checks, outputs

Per-step milliseconds per part go to stdout as a Markdown table (and `--json`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench import deepseek
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.model.loader import load_model
from services.model.loading.sources import cache_root

SHAPE = dict(  # bench.deepseek's model, narrower: 6 layers, 24 experts of 384, 6 per token
    deepseek.SHAPE,
    moe_intermediate_size=384,
    num_hidden_layers=6,
    n_routed_experts=24,
    num_experts_per_tok=6,
    q_lora_rank=512,
)
PARTS = (
    "MLA projections", "absorption products", "MLA attention", "attention output",
    "dense MLPs", "routing", "expert products", "expert dispatch", "norms and residual",
    "logits", "forward, rest", "sampling", "serving loop",
)  # fmt: skip


class Clock:
    """Exclusive wall time per part: entering a part pauses the one it was called from."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._stack: list[tuple[str, float]] = []
        self.on = False
        self.wrapped: dict[Any, list[tuple[str, Any]]] = {}  # owner: (attribute, original)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        now = time.perf_counter()
        if self._stack:
            outer, since = self._stack[-1]
            self.spent[outer] += now - since
        self._stack.append((name, now))
        try:
            yield
        finally:
            end = time.perf_counter()
            name, since = self._stack.pop()
            self.spent[name] += end - since
            if self._stack:
                self._stack[-1] = (self._stack[-1][0], end)

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """owner.attribute (a function or a bound method) timed as part `name`."""
        inner = getattr(owner, attribute)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return inner(*args, **kwargs)

        setattr(owner, attribute, timed)
        self.wrapped.setdefault(owner, []).append((attribute, inner))

    def unwrap(self) -> None:
        """Every function wrapped put back (a library outlives the model it was timed for)."""
        for owner, originals in self.wrapped.items():
            for attribute, inner in reversed(originals):
                setattr(owner, attribute, inner)
        self.wrapped.clear()


def instrument(engine: Engine, clock: Clock) -> None:
    """Wrap the functions each part runs, on this engine's model (its objects, not classes,
    where one class serves several parts: a DenseMlp is a shared expert or a routed one)."""
    from services.model.layers import moe as moe_module

    model: Any = engine.runner.model
    clock.wrap(engine, "step", "serving loop")
    clock.wrap(engine.runner, "forward", "forward, rest")
    clock.wrap(engine.runner, "sample", "sampling")
    clock.wrap(model, "lm_head", "logits")
    clock.wrap(model.ops, "add_rms_norm", "norms and residual")
    attention = model.mla  # DeepseekModel: its latent attention
    clock.wrap(attention, "project", "MLA projections")
    clock.wrap(attention, "heads_matmul", "absorption products")
    if hasattr(attention, "_attend"):
        clock.wrap(attention, "_attend", "MLA attention")
    for layer in model.layers:
        o = _Timed(layer.attention.o, clock, "attention output")
        object.__setattr__(layer.attention, "o", o)  # a frozen dataclass's field
        mlp = layer.mlp
        if isinstance(mlp, moe_module.Moe):
            clock.wrap(mlp, "route", "routing")
            clock.wrap(mlp, "routed", "expert dispatch")
            if mlp.shared is not None:
                object.__setattr__(mlp, "shared", _Timed(mlp.shared, clock, "dense MLPs"))
            grouped = _grouped_library(mlp.experts)
            if grouped is not None:  # the layer's experts in one C call (one library)
                if grouped not in clock.wrapped:
                    clock.wrap(grouped, "bf16_experts", "expert products")
            else:  # expert by expert
                timed: list[Any] = [_Timed(e, clock, "expert products") for e in mlp.experts if e]
                mlp.experts = timed
        else:
            object.__setattr__(layer, "mlp", _Timed(mlp, clock, "dense MLPs"))


def _grouped_library(experts: list[Any]) -> Any:
    """The library whose one call runs these experts (moe.run_grouped's choice for
    bfloat16 rows), or None (older trees: no grouped call)."""
    from services.model.layers import moe as moe_module

    choose = getattr(moe_module, "_grouped_library", None)
    grouped = None if choose is None else choose(experts, torch.empty(0, dtype=torch.bfloat16))
    return None if grouped is None else grouped[0]


class _Timed:
    """A callable part timed (a DenseMlp: frozen, so wrapped rather than patched)."""

    def __init__(self, inner: Callable[..., Any], clock: Clock, name: str) -> None:
        self.inner, self.clock, self.name = inner, clock, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.part(self.name):
            return self.inner(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)


def breakdown(path: Path, dtype: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step in each part, and "step" (their sum, measured whole)."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    per_seq = -(-(context + steps + 8) // 16)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=batch * per_seq + 8))
    clock = Clock()
    instrument(engine, clock)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(100, 49000, (context,), generator=gen).tolist()
        params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while any(s.num_computed_tokens < context for r in engine.requests.values() for s in r.seqs):
        engine.step()  # the prompts, and the first decode steps: warm-up
    for _ in range(2):
        engine.step()
    clock.on = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    whole = time.perf_counter() - start
    clock.unwrap()
    ms = {part: 1e3 * t / steps for part, t in clock.spent.items()}
    ms["step"] = 1e3 * whole / steps
    return ms


def prefill_breakdown(path: Path, dtype: str, prompts: int, length: int) -> dict[str, float]:
    """Milliseconds in each part, and "step" (the whole), to compute `prompts` prompts of
    `length` tokens from an empty cache (chunked as the engine's defaults chunk them)."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    blocks = prompts * (-(-(length + 8) // 16)) + 8
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=blocks))
    gen = torch.Generator().manual_seed(length)

    def submit(tag: str) -> None:
        for i in range(prompts):
            prompt = torch.randint(100, 49000, (length,), generator=gen).tolist()
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            engine.add_request(EngineRequest(f"{tag}{i}", prompt, params))

    submit("warm")
    while engine.has_unfinished:
        engine.step()
    clock = Clock()
    instrument(engine, clock)
    submit("timed")
    clock.on = True
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    whole = time.perf_counter() - start
    clock.unwrap()
    return {**{part: 1e3 * t for part, t in clock.spent.items()}, "step": 1e3 * whole}


def table(rows: dict[int, dict[str, float]]) -> str:
    batches = sorted(rows)
    lines = [
        "| ms per decode step | " + " | ".join(f"b={b}" for b in batches) + " |",
        "| --- |" + " ---: |" * len(batches),
    ]
    for part in (*PARTS, "step"):
        cells = []
        for b in batches:
            share = 100 * rows[b][part] / rows[b]["step"]
            cells.append(f"{rows[b][part]:.2f}" + ("" if part == "step" else f" ({share:.0f}%)"))
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--checkpoint", type=Path, help="where the random checkpoint lives")
    parser.add_argument(
        "--prefill", type=int, default=0, metavar="N",
        help="instead: the parts of computing N prompts of --context tokens (ms in all)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    path = args.checkpoint or cache_root() / "bench" / "deepseek-v3-moe-24x6"
    deepseek.checkpoint(path, SHAPE)
    rows = {}
    if args.prefill:
        rows[args.prefill] = prefill_breakdown(path, args.dtype, args.prefill, args.context)
        print(table(rows).replace("ms per decode step", f"ms for {args.context}-token prompts"))
        return 0
    for b in (int(x) for x in args.batches.split(",")):
        print(f"step_breakdown: batch {b}", file=sys.stderr, flush=True)
        rows[b] = breakdown(path, args.dtype, b, args.context, args.steps)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({str(b): r for b, r in rows.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
