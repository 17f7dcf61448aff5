"""Expert parallelism (services/model/experts/expert_parallel.py): the experts over 2 real processes
(rank 1 started by expert_parallel.start, as a worker starts it: an expert-only data-parallel
rank) answer as one process token for token and logprob for logprob, greedy and seeded, in
every MoE family and every dtype this CPU computes in; and the balancer moves experts under a
skewed load while sequences run, evening out the ranks' rows without changing an answer."""

from __future__ import annotations

import pytest
import torch

from bench.expert_parallel import skewed_prompts
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.experts.expert_parallel import Spec, start
from services.model.loader import load_model
from services.model.parallel.balancer import Balance
from tests.support.dtypes import COMPUTE_DTYPES

MOE_FAMILIES = [
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "deepseek_v4",
]  # fmt: skip
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=11, logprobs=2),
]


def answers(loaded, prompts, params, **config):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=256, **config))
    out = engine.generate(prompts, params)
    return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for o in out for c in o.choices]


def spread(path, dtype: str, redundant: int = 2, **balancer):
    """The model loaded here as rank 0, its experts over this process and one more."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    spec = Spec(str(path), dtype, "cpu", "auto", ranks=2, redundant=redundant, **balancer)
    return loaded, start(loaded.model, spec)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_two_ranks_answer_as_one_process(tiny_dir, family, dtype):
    path = tiny_dir(family)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (23, 5, 40)]
    prompts, params = prompts * 2, [p for p in PARAMS for _ in range(3)]
    one = answers(load_model(str(path), dtype=dtype, device="cpu"), prompts, params)
    loaded, group = spread(path, dtype)
    try:
        assert answers(loaded, prompts, params) == one
        rows = group.snapshot()["rank_tokens"]
        computed = [n for _, n in group.rank_stats()]  # as each rank counted them
    finally:
        group.stop()
    assert group.processes[0].returncode == 0  # told to stop, it stopped
    assert len(rows) == len(loaded.model.moe_layers())
    # rank 1 computed rows (gpt-oss's biased routers leave it idle in some layers: skew)
    assert sum(per_rank[1] for per_rank in rows.values()) > 0, rows
    assert computed == [sum(per_rank[r] for per_rank in rows.values()) for r in range(2)]


# -- the balancer under a skewed load ------------------------------------------------------

# 10 slots: rank 0 holds experts 0-4, rank 1 experts 5-7 and second copies of 0 and 1
ONLY_ON_RANK_0 = {2, 3, 4}


def stream(engine: Engine, prompts, params, between=lambda passes: None) -> dict[str, list]:
    """Each request's deltas as they came, stepping the engine by hand (`between(passes)`
    runs after each pass)."""
    from services.engine.request import EngineRequest

    for j, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(EngineRequest(f"r{j}", prompt, p))
    deltas: dict[str, list] = {f"r{j}": [] for j in range(len(prompts))}
    passes = 0
    while engine.has_unfinished:
        for d in engine.step():
            deltas[d.request_id].append((d.token_ids, [lp.logprob for lp in d.logprobs]))
        passes += 1
        between(passes)
    return deltas


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_rebalancing_a_skewed_load_evens_the_ranks_and_changes_no_token(tiny_dir, dtype):
    """Asked for after pass 3, the plan is made at pass 4 from passes 1-3 and applied one
    layer a pass at passes 5-7; the same passes from 7 on are compared with and without it."""
    path = tiny_dir("qwen3_moe")
    reference = load_model(str(path), dtype=dtype, device="cpu")
    prompts = skewed_prompts(reference, 8, 128, ONLY_ON_RANK_0)
    params = [PARAMS[j % 2] for j in range(len(prompts))]  # greedy and seeded
    config = EngineConfig(num_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False)
    one = stream(Engine(reference.model, reference.tokenizer, config), prompts, params)

    loaded, group = spread(path, dtype)

    def from_pass_7(passes: int) -> None:
        if passes == 6:
            group.balance = Balance()

    try:  # without rebalancing: rank 0 computes most rows
        fixed = stream(Engine(loaded.model, loaded.tokenizer, config), prompts, params, from_pass_7)
        unbalanced = group.balance.imbalance
    finally:
        group.stop()
    loaded, group = spread(path, dtype)
    placements = []

    def rebalance_after_pass_3(passes: int) -> None:
        if passes == 3:
            group.request_rebalance()
            placements.append(dict(group.placement))

    try:
        moved = stream(
            Engine(loaded.model, loaded.tokenizer, config), prompts, params, rebalance_after_pass_3
        )
        snapshot = group.snapshot()
    finally:
        group.stop()

    assert fixed == one and moved == one  # every stream, delta for delta, logprobs too
    before, after = snapshot["imbalance_before_rebalance"], snapshot["imbalance"]
    print(
        f"imbalance, max over mean rows per rank: passes 1-3 {before:.3f}; passes 7 on: "
        f"{unbalanced:.3f} unbalanced, {after:.3f} rebalanced"
    )
    assert before > 1.6 and unbalanced > 1.6
    assert after < 1.1
    # every layer moved; each rank loaded exactly the experts it did not hold before
    start, end = placements[0], group.placement
    loads = 0
    for layer in start:
        assert end[layer] != start[layer]
        for r in range(2):
            held = set(start[layer][r * 5 : (r + 1) * 5])
            loads += len(set(end[layer][r * 5 : (r + 1) * 5]) - held)
    assert snapshot["experts_loaded"] == loads and snapshot["rebalances"] == 1


# -- a process's share of the experts is all it reads and builds ---------------------------


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "deepseek_v4"])
def test_a_share_reads_and_builds_only_its_experts(tiny_dir, family):
    from services.model.experts.eplb import Share
    from services.model.loading import hf_config, hf_dir

    path = tiny_dir(family)
    config = hf_config.read_config(path)
    share = Share(1, 2, redundant=2)  # slots 5..9 of 10 over 8 experts: 5, 6, 7, 0, 1
    held = share.experts(config.moe.num_experts)
    assert held == {5, 6, 7, 0, 1}
    weights = hf_dir.read_weights(path, config, experts=held)
    read = {int(m[1]) for name in weights.keys() if (m := hf_dir.EXPERT.search(name))}  # noqa: SIM118
    assert read == held  # the others' tensors never reached memory
    others = [n for n in weights.files if (m := hf_dir.EXPERT.search(n)) and int(m[1]) not in held]
    assert others and all(n in weights for n in others)  # each still readable from its file
    model = load_model(str(path), "float32", "cpu", experts=share).model
    for moe in model.moe_layers().values():
        assert [e for e, m in enumerate(moe.experts) if m is not None] == sorted(held)
        assert moe.hold([2, 3]) == 2  # a slot given another expert builds it from its file
