"""Data-parallel ranks of a MoE model (services/model/parallel/data.py): two processes over
gloo, each a whole engine with its own prompts and half of every MoE layer's experts, keep in
step by votes and empty passes and exchange rows all-to-all; each rank's tokens, text,
logprobs and prompt logprobs equal one process's for the same prompts, greedy and seeded, in
every dtype `--dtype auto` picks here. Rank 1 has fewer prompts: it runs empty passes while
rank 0 goes on."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
import torch

from services.engine import offline
from services.engine.engine import Engine, EngineConfig
from services.launcher import free_port
from services.model.experts import eplb
from services.model.loader import load_model
from services.model.parallel import data, experts_only, ranks
from services.settings import SettingsError, build, check
from tests.services.engine.test_async_scheduling import MIX, outcome
from tests.services.engine.test_determinism import prompt
from tests.support.dtypes import COMPUTE_DTYPES

LENGTHS = [3, 17, 33, 40, 49, 64, 65, 81, 100, 111, 16, 31]
PROMPTS = [prompt(n, seed=500 + i) for i, n in enumerate(LENGTHS)]
SHARES = [(PROMPTS, MIX), (PROMPTS[:3], MIX[:3])]  # rank 1 finishes early
RANKS = len(SHARES)


def _exit(out) -> None:
    """A rank process's end once its result is delivered: at once, without the interpreter's
    teardown, in which a process holding torch.distributed groups made directly has aborted
    (SIGABRT, "terminate called without an active exception": 1 run of the whole file in 2
    here, after Lockstep.leave too). Its results are what the test checks."""
    out.close()
    out.join_thread()
    os._exit(0)


class _InStep:
    """An engine whose every step is one round of the ranks' votes (as the worker's driver);
    `ask_after` steps, a plan requested (as POST /experts/rebalance would)."""

    def __init__(self, engine: Engine, lockstep: data.Lockstep, ask_after: int = 0) -> None:
        self.engine, self.lockstep, self.ask_after = engine, lockstep, ask_after
        self.tokenizer = engine.tokenizer
        self.steps = 0

    @property
    def requests(self):
        return self.engine.requests

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def add_request(self, request) -> None:
        self.engine.add_request(request)

    def step(self):
        deltas = self.engine.step()
        self.lockstep.round_done()
        self.steps += 1
        if self.steps == self.ask_after:
            self.lockstep.request_rebalance()
        return deltas


def _rank(
    path: str, dtype: str, balance: data.Balancing, tp: int, rank: int, port: int, out
) -> None:
    """Data-parallel rank `rank`: alone, or the first of `tp` tensor ranks it starts."""
    torch.set_num_threads(1)
    try:  # whatever happens, the test hears of it rather than waiting
        grid = data.Grid(rank, RANKS, f"127.0.0.1:{port}", balance)
        loaded = load_model(path, dtype=dtype, device="cpu", tensor=(0, tp))
        model: Any = loaded.model
        if tp > 1:
            model = ranks.start(model, ranks.Spec(path, dtype, "cpu", "auto", tp, grid))
            lockstep = data.join(model.inner, grid, model.leader.group, model.leader.empty)
        else:
            lockstep = data.join(model, grid)
        engine = Engine(model, loaded.tokenizer, EngineConfig(num_blocks=128))
        prompts, params = SHARES[rank]
        ask_after = 3 if balance == ASKED and rank == 1 else 0  # after some load to plan from
        stepped = _InStep(engine, lockstep, ask_after)
        got = outcome(offline.generate(stepped, prompts, params, "dp"))
        while lockstep.idle():  # the other ranks' passes, until none has one
            pass
        if tp > 1:
            model.leader.stop()
        shown = lockstep.snapshot()
        lockstep.leave()
        out.put((rank, got, shown))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}", {}))
    _exit(out)


STILL = data.Balancing()
MOVING = data.Balancing(redundant=2, interval=3)  # second copies, a new placement often
ASKED = data.Balancing(redundant=2)  # no plans but the one rank 1 asks for


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize(
    ("family", "balance"),
    [
        ("qwen3_moe", STILL),
        ("deepseek_v3", STILL),
        ("deepseek_v4", STILL),
        ("qwen3_moe", MOVING),
        ("deepseek_v3", MOVING),
        ("qwen3_moe", ASKED),
    ],
    ids=[
        "qwen3_moe",
        "deepseek_v3",
        "deepseek_v4",
        "qwen3_moe-rebalanced",
        "deepseek_v3-rebalanced",
        "qwen3_moe-asked",
    ],
)
def test_ranks_answer_as_one_process(tiny_dir, family, balance, dtype):
    """Each rank's answers are one process's; with --redundant-experts 2 and a plan every 3
    passes from both ranks' loads, the experts move while the ranks serve, answers unchanged;
    a plan one rank asks for is made once, by both ranks at the same pass."""
    _grid_answers_as_one_process(str(tiny_dir(family)), dtype, balance, tp=1)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize(
    ("family", "balance"),
    [
        ("qwen3_moe", STILL),
        ("deepseek_v3", data.Balancing(redundant=4, interval=3)),
        ("deepseek_v4", STILL),
    ],
    ids=["qwen3_moe", "deepseek_v3-rebalanced", "deepseek_v4"],
)
def test_a_grid_of_data_and_tensor_ranks_answers_as_one_process(tiny_dir, family, balance, dtype):
    """DP 2 x TP 2 (four processes): each data-parallel rank's heads split over its two
    tensor ranks (DeepSeek-V3's latent and V4's rows whole on both, V4's batches crossing to
    its tensor ranks with their cache groups' tables), the experts over all four (rebalanced
    too), its answers one process's."""
    _grid_answers_as_one_process(str(tiny_dir(family)), dtype, balance, tp=2)


def _run_ranks(targets: list[tuple[Any, tuple]]) -> dict[int, tuple[Any, dict]]:
    """Each (target, args) in a process of its own, given the result queue last; every
    rank's (answers or error, snapshot) by rank, once every process has exited 0."""
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    procs = [spawn.Process(target=t, args=(*args, out)) for t, args in targets]
    for p in procs:
        p.start()
    results = {r: (got, shown) for r, got, shown in (out.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def _grid_answers_as_one_process(path: str, dtype: str, balance: data.Balancing, tp: int) -> None:
    one = load_model(path, dtype=dtype, device="cpu")
    reference = Engine(one.model, one.tokenizer, EngineConfig(num_blocks=128))
    expected = [outcome(reference.generate(p, params)) for p, params in SHARES]
    port = free_port()
    results = _run_ranks([(_rank, (path, dtype, balance, tp, r, port)) for r in range(RANKS)])
    errors = [got for got, _ in results.values() if isinstance(got, str)]
    assert not errors
    for r in range(RANKS):
        assert results[r][0] == expected[r], f"rank {r}"
    shown = [results[r][1] for r in range(RANKS)]
    assert shown[1]["empty_passes"] > 0 and shown[0]["empty_passes"] == 0  # rank 1's, not 0's
    assert shown[0]["passes"] == shown[1]["passes"]  # in step
    assert shown[0]["placement"] == shown[1]["placement"]  # the same plans
    if balance.interval:
        assert all(s["rebalances"] > 0 and s["experts_loaded"] > 0 for s in shown)
    if balance == ASKED:
        assert [s["rebalances"] for s in shown] == [1, 1]
        first = eplb.initial(8, 10)  # the tiny Qwen3-MoE's 8 experts in 10 slots
        assert any(p != first for p in shown[0]["placement"].values())  # the plan moved some


def _serving_rank(path: str, dtype: str, port: int, out) -> None:
    """Rank 0 with every request; it stops the group when done."""
    torch.set_num_threads(1)
    try:
        loaded = load_model(path, dtype=dtype, device="cpu")
        lockstep = data.join(loaded.model, data.Grid(0, 2, f"127.0.0.1:{port}"))
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
        got = outcome(offline.generate(_InStep(engine, lockstep), PROMPTS, MIX, "dp"))
        shown = lockstep.snapshot()
        lockstep.finish()
        out.put((0, got, shown))
    except Exception as e:
        out.put((0, f"{type(e).__name__}: {e}", {}))
    _exit(out)


def _experts_only_rank(path: str, dtype: str, port: int, out) -> None:
    torch.set_num_threads(1)
    try:
        model = load_model(path, dtype=dtype, device="cpu").model
        lockstep = experts_only.hold_experts(model, data.Grid(1, 2, f"127.0.0.1:{port}"))
        experts_only.serve(lockstep)
        out.put((1, None, lockstep.snapshot()))
    except Exception as e:
        out.put((1, f"{type(e).__name__}: {e}", {}))
    _exit(out)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_an_experts_only_rank_serves_rank_0s_passes(tiny_dir, dtype):
    """The rank-0 layout as data-parallel ranks (experts_only.py): rank 0 has every request,
    rank 1 holds half the experts and nothing else, running an empty pass for each of rank
    0's; rank 0's answers are one process's, and its stop ends rank 1's loop (both exit 0)."""
    path = str(tiny_dir("qwen3_moe"))
    one = load_model(path, dtype=dtype, device="cpu")
    expected = outcome(
        Engine(one.model, one.tokenizer, EngineConfig(num_blocks=128)).generate(PROMPTS, MIX)
    )
    port = free_port()
    results = _run_ranks([(t, (path, dtype, port)) for t in (_serving_rank, _experts_only_rank)])
    assert results[0][0] == expected
    served, helped = results[0][1], results[1][1]
    assert helped["empty_passes"] == served["passes"] > 0 and served["empty_passes"] == 0


@pytest.mark.parametrize(
    ("family", "values", "message"),
    [
        (
            "qwen3_moe",
            {"data_parallel": 3},
            "8 experts \\+ 0 redundant slots do not divide over 3 ranks",
        ),
        (
            "qwen3_moe",
            {"data_parallel": 2, "data_parallel_rank": 1},
            "data_parallel_address: '' is not host:port",
        ),
        (
            "qwen3_moe",
            {"data_parallel": 2, "data_parallel_address": "nowhere"},
            "data_parallel_address: 'nowhere' is not host:port",
        ),
        (
            "qwen3_moe",
            {"data_parallel": 2, "data_parallel_rank": 2, "data_parallel_address": "h:1"},
            "data_parallel_rank: 2 is not below --data-parallel 2",
        ),
        (
            "qwen3_moe",
            {"data_parallel": 2, "data_parallel_address": "h:1", "expert_parallel": 2},
            "not yet with --expert-parallel",
        ),
    ],
)
def test_data_parallel_settings_that_cannot_work_are_refused(tiny_dir, family, values, message):
    with pytest.raises(SettingsError, match=message):
        check(build("decode", model=str(tiny_dir(family)), **values))
    check(build("up", model=str(tiny_dir("qwen3_moe")), data_parallel=2))  # up gives the rest
    check(build("decode", model=str(tiny_dir("qwen3_moe")), data_parallel=2))  # starts the rest
    check(build("decode", model=str(tiny_dir("qwen3")), data_parallel=3))  # dense: replicas
