"""Data-parallel ranks beside speculative decoding (services/model/parallel/data.py, services/
engine/speculative.py): two ranks of a tiny DeepSeek-V3 with its own MTP layer, each drafting
with it, keep in step (a step's verifying pass casts the vote; the MTP layer's experts are
its own, computed where it runs) and each rank's greedy and seeded tokens, logprobs and
prompt logprobs equal one process's without speculation, with drafts accepted, in every
dtype `--dtype auto` picks here."""

from __future__ import annotations

import pytest
import torch

from services.engine import offline
from services.engine.engine import Engine, EngineConfig
from services.launcher import free_port
from services.model.loader import load_model, load_mtp
from services.model.parallel import data
from services.settings import SpeculativeConfig
from tests.services.engine.test_async_scheduling import outcome
from tests.services.model.test_data_parallel import RANKS, SHARES, _exit, _InStep, _run_ranks
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_models import save_tiny_mtp

MTP = SpeculativeConfig("mtp", num_tokens=3, max_batch=64)


@pytest.fixture(scope="module")
def drafting_checkpoint(tmp_path_factory, embedded_dir):
    """The tiny DeepSeek-V3 whose MTP layer repeats its first layer: its drafts are taken."""
    path = tmp_path_factory.mktemp("dp-mtp")
    save_tiny_mtp(path, embedded_dir, copy=True)
    return path


def _drafting_rank(path: str, dtype: str, rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    try:
        loaded = load_model(path, dtype=dtype, device="cpu")
        m = loaded.model
        lockstep = data.join(m, data.Grid(rank, RANKS, f"127.0.0.1:{port}"))
        mtp = load_mtp(loaded.path, loaded.config, m.dtype, m.device, m.kernels)
        config = EngineConfig(num_blocks=128, speculative=MTP)
        engine = Engine(m, loaded.tokenizer, config, draft=mtp)
        prompts, params = SHARES[rank]
        got = outcome(offline.generate(_InStep(engine, lockstep), prompts, params, "dp"))
        while lockstep.idle():  # the other rank's passes, until neither has one
            pass
        assert engine.speculator is not None
        shown = lockstep.snapshot() | {"accepted": engine.speculator.stats.accepted}
        lockstep.leave()
        out.put((rank, got, shown))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}", {}))
    _exit(out)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_drafting_ranks_answer_as_one_process_without_drafts(drafting_checkpoint, dtype):
    path = str(drafting_checkpoint)
    one = load_model(path, dtype=dtype, device="cpu")
    reference = Engine(one.model, one.tokenizer, EngineConfig(num_blocks=128))
    expected = [outcome(reference.generate(p, params)) for p, params in SHARES]
    port = free_port()
    results = _run_ranks([(_drafting_rank, (path, dtype, r, port)) for r in range(RANKS)])
    assert not [got for got, _ in results.values() if isinstance(got, str)], results
    for r in range(RANKS):
        assert results[r][0] == expected[r], f"rank {r}"
    shown = [results[r][1] for r in range(RANKS)]
    assert all(s["accepted"] > 0 for s in shown)  # the MTP layer's drafts were taken
    assert shown[0]["passes"] == shown[1]["passes"] and shown[1]["empty_passes"] > 0
