"""Expert parallelism and its balancer on this machine.

    python -m bench.expert_parallel [--dtype bfloat16] [--seqs 16] [--prompt-len 64]
                                    [--max-tokens 32] [--model DIR]

On bench.deepseek's random DeepSeek-V3-shaped checkpoint (7 MoE layers of 32 experts, top 4 of
4 groups; made once with transformers) unless --model names another MoE checkpoint; each part
in one run, as Markdown tables:

1. the same batch (`--seqs` random prompts, greedy) on 1 process and on 2 (the experts split,
   no redundant slots): tokens/s and, for 2, what rank 0's MoE exchanges spent per forward
   pass: its own experts, the rest of the exchanges (the all-to-alls, waiting for rank 1's
   rows), rank 1's compute (as the votes carry it), and the rest of that wait, the transfers
   and hand-offs: communication's share of a pass, the figure to carry to real hardware (on
   2 cores the ranks also share the cores);
2. the planner on synthetic skewed loads (Zipf over DeepSeek-V3's 256 experts in 8 groups):
   max over mean rank load before (the initial placement) and after each policy, by ranks and
   redundant slots: exact, from eplb.imbalance;
3. a skewed trace measured on 2 ranks (prompts repeating the token whose routes load rank 0
   most, 10 slots... 32 + 2 here): rows per rank before and after one live rebalance, the
   longest pause one layer's move took, and whether every answer stayed the same.
What a process of N holds after loading its share of the experts: bench.load_memory.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from bench.deepseek import checkpoint, log
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.model.experts import eplb
from services.model.experts.expert_parallel import ExpertGroup, Spec, start
from services.model.loader import LoadedModel, cpu_has_bf16_units, load_model
from services.model.parallel.balancer import Balance
from services.model.parallel.exchange import LockstepTiming


def skewed_prompts(loaded: LoadedModel, n: int, length: int, rank_0: set[int]) -> list[list[int]]:
    """Prompts whose rows go mostly to the experts in `rank_0`: a token repeated routes every
    position alike (identical rows attend to identical values), so each prompt repeats the
    token whose own routes land most there (serve them with prefix caching off)."""
    chosen: dict[int, torch.Tensor] = {}

    def recording(i, route):
        def routed(x, ops):
            weights, ids = route(x, ops)
            chosen[i] = ids  # each candidate's experts, in its row
            return weights, ids

        return routed

    layers = loaded.model.moe_layers()
    for i, moe in layers.items():
        moe.route = recording(i, moe.route)  # type: ignore[method-assign]
    candidates = list(range(1000, 1500))
    config = EngineConfig(num_blocks=600, max_num_seqs=512)  # one pass: 500 tokens
    try:
        engine = Engine(loaded.model, loaded.tokenizer, config)
        engine.generate([[v] for v in candidates], SamplingParams(max_tokens=1, temperature=0))
    finally:
        for moe in layers.values():
            del moe.route  # the class's again
    assert all(len(ids) == len(candidates) for ids in chosen.values())  # one pass for all
    hot = torch.tensor(sorted(rank_0))
    share = torch.stack([torch.isin(ids, hot).sum(1) for ids in chosen.values()]).sum(0)
    return [[candidates[int(share.argmax())]] * length] * n


def run(engine: Engine, prompts, params, between=lambda passes: None):
    """Each request's tokens, and passes and seconds, stepping the engine by hand."""
    for j, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{j}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{j}": [] for j in range(len(prompts))}
    passes, start_s = 0, time.perf_counter()
    while engine.has_unfinished:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
        passes += 1
        between(passes)
    return tokens, passes, time.perf_counter() - start_s


def spread(path: Path, dtype: str, redundant: int = 0) -> tuple[LoadedModel, ExpertGroup]:
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    return loaded, start(loaded.model, Spec(str(path), dtype, "cpu", "auto", 2, redundant))


def speed_table(path: Path, dtype: str, seqs: int, prompt_len: int, max_tokens: int) -> str:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt_len,), generator=g).tolist() for _ in range(seqs)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    config = EngineConfig(num_blocks=1024)
    one = load_model(str(path), dtype=dtype, device="cpu")
    run(Engine(one.model, one.tokenizer, config), prompts[:2], params)  # warm-up
    tokens_1, passes_1, seconds_1 = run(Engine(one.model, one.tokenizer, config), prompts, params)
    del one
    loaded, group = spread(path, dtype)
    try:
        run(Engine(loaded.model, loaded.tokenizer, config), prompts[:2], params)
        before = group.rank_stats()
        start_t = LockstepTiming(**vars(group.exchange.timing))
        tokens_2, passes_2, seconds_2 = run(
            Engine(loaded.model, loaded.tokenizer, config), prompts, params
        )
        after = group.rank_stats()
    finally:
        group.stop()
    t, made = group.exchange.timing, seqs * max_tokens
    local_ns = after[0][0] - before[0][0]
    exchange_ns = t.exchange_ns - start_t.exchange_ns
    local, wait = local_ns / passes_2 / 1e6, (exchange_ns - local_ns) / passes_2 / 1e6
    remote = (after[1][0] - before[1][0]) / passes_2 / 1e6
    step = seconds_2 / passes_2 * 1e3
    comm = max(0.0, wait - max(0.0, remote - local))
    rows = [
        "| processes | tokens/s | ms per pass | rank 0's experts | waiting on rank 1 | "
        "rank 1's experts | transfers and hand-offs (share of a pass) | same tokens |",
        "|---|---|---|---|---|---|---|---|",
        f"| 1 | {made / seconds_1:.1f} | {seconds_1 / passes_1 * 1e3:.1f} | | | | | |",
        f"| 2 | {made / seconds_2:.1f} | {step:.1f} | {local:.1f} ms | {wait:.1f} ms | "
        f"{remote:.1f} ms | {comm:.1f} ms ({comm / step:.0%}) | {tokens_2 == tokens_1} |",
    ]
    return "\n".join(rows)


def planner_table() -> str:
    """Zipf(s) loads over 256 experts in 8 groups (the hot ones anywhere), nodes of 8 ranks
    (at least 2)."""
    rows = [
        "| load | ranks | redundant | initial | global | hierarchical (nodes) |",
        "|---|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(1)
    for s in (0.6, 1.0):
        load = (1.0 / torch.arange(1, 257).double() ** s)[torch.randperm(256, generator=g)]
        for ranks, redundant in ((8, 0), (8, 32), (32, 32), (64, 64)):
            slots, nodes = 256 + redundant, max(ranks // 8, 2)
            start_ = eplb.initial(256, slots)
            row = [eplb.imbalance(load.tolist(), start_, ranks)]
            for policy in ("global", "hierarchical"):
                placed = eplb.plan(load.tolist(), start_, ranks, policy, nodes, 8)
                row.append(eplb.imbalance(load.tolist(), placed, ranks))
            rows.append(
                f"| Zipf {s} | {ranks} | {redundant} | {row[0]:.2f} | {row[1]:.2f} | "
                f"{row[2]:.2f} ({nodes}) |"
            )
    return "\n".join(rows)


def skew_table(path: Path, dtype: str) -> str:
    reference = load_model(str(path), dtype=dtype, device="cpu")
    slots = reference.config.moe.num_experts + 2  # type: ignore[union-attr]
    rank_0 = set(eplb.initial(slots - 2, slots)[: slots // 2]) - set(
        eplb.initial(slots - 2, slots)[slots // 2 :]
    )
    prompts = skewed_prompts(reference, 8, 256, rank_0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = EngineConfig(num_blocks=512, max_num_batched_tokens=128, enable_prefix_caching=False)
    one, _, _ = run(Engine(reference.model, reference.tokenizer, config), prompts, params)
    del reference
    figures = []
    for rebalance in (False, True):
        loaded, group = spread(path, dtype, redundant=2)
        layers = len(group.layers)

        def between(
            passes: int, group: ExpertGroup = group, rebalance: bool = rebalance, layers=layers
        ) -> None:
            if passes == 3 and rebalance:
                group.request_rebalance()  # planned at pass 4, applied at passes 5..4+layers
            if passes == 3 + layers and not rebalance:
                group.balance = Balance()  # the same window as the rebalanced run's "after"

        try:
            tokens, passes, seconds = run(
                Engine(loaded.model, loaded.tokenizer, config), prompts, params, between
            )
            snap = group.snapshot()
        finally:
            group.stop()
        figures.append((snap, tokens == one, seconds / passes * 1e3))
    (fixed, same_fixed, _), (moved, same_moved, step) = figures
    return "\n".join(
        [
            "| run | imbalance, passes 1-3 | imbalance after the move's passes | experts loaded | "
            "longest pause (one layer) | ms per pass | same tokens |",
            "|---|---|---|---|---|---|---|",
            f"| placement kept | | {fixed['imbalance']:.3f} | 0 | | | {same_fixed} |",
            f"| rebalanced live | {moved['imbalance_before_rebalance']:.3f} | "
            f"{moved['imbalance']:.3f} | {moved['experts_loaded']} | "
            f"{moved['longest_pause_ms']:.1f} ms | {step:.1f} | {same_moved} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16" if cpu_has_bf16_units() else "float32")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", type=Path, default=None, help="a MoE checkpoint directory")
    p.add_argument("--skip", default="", help="comma-separated: speed, planner, skew")
    a = p.parse_args(argv)
    path = a.model or checkpoint()
    skip = set(a.skip.split(","))
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{a.dtype}, {path.name}\n"
    )
    if "speed" not in skip:
        log("1 process against 2")
        print(speed_table(path, a.dtype, a.seqs, a.prompt_len, a.max_tokens) + "\n")
    if "planner" not in skip:
        print(planner_table() + "\n")
    if "skew" not in skip:
        log("a skewed trace, rebalanced live")
        print(skew_table(path, a.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
