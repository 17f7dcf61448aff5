"""The KV pool's size from the device's memory (services/engine/pool_budget.py), with a mocked
free-memory figure (no GPU here): --gpu-memory-utilization's share less what the device holds
and what a step needs; --kv-cache-gb and --num-blocks override it; a share that leaves nothing
is refused with what was in use."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.group_pool import pool_sizes
from services.engine.pool_budget import CPU_POOL_BYTES, GRAPH_BYTES, kv_budget, step_bytes
from services.settings.sections import GIB, SettingsError

CUDA = torch.device("cuda")


def h200(free_gib: float):
    """torch.cuda.mem_get_info of a 140 GiB device with `free_gib` free."""
    return lambda device: (int(free_gib * GIB), 140 * GIB)


def test_a_steps_bytes_for_the_embedded_model(embedded):
    mc = embedded.config  # SmolLM2-135M: hidden 576, MLP 1536, 9 query and 3 KV heads of 64
    row = 3 * 1536 + 8 * 576 + 576 + 2 * 192
    expected = 2 * 512 * row * 2 + 512 * 49152 * 20
    assert step_bytes(mc, EngineConfig(), itemsize=2) == expected == 524_156_928


def test_the_pool_gets_the_share_less_what_is_held_and_a_step(embedded):
    mc = embedded.config
    config = EngineConfig(gpu_memory_utilization=0.9)
    budget = kv_budget(mc, config, 2, CUDA, h200(free_gib=139))  # 1 GiB held: context, weights
    assert budget == int(0.9 * 140 * GIB) - GIB - step_bytes(mc, config, 2) - GRAPH_BYTES
    half = kv_budget(mc, EngineConfig(gpu_memory_utilization=0.5), 2, CUDA, h200(139))
    assert budget - half == int(0.9 * 140 * GIB) - int(0.5 * 140 * GIB)
    no_graphs = EngineConfig(gpu_memory_utilization=0.9, cuda_graph_max_batch=0)
    assert kv_budget(mc, no_graphs, 2, CUDA, h200(139)) == budget + GRAPH_BYTES
    # another process holding 60 GiB of the device leaves that much less
    assert kv_budget(mc, config, 2, CUDA, h200(79)) == budget - 60 * GIB
    blocks, _ = pool_sizes(mc.cache_spec, config, 2, budget)
    whole = mc.cache_layers * config.block_size * mc.cache_elements * 2
    assert blocks == budget // whole


def test_kv_cache_gb_and_num_blocks_override_the_share(embedded):
    mc = embedded.config
    assert kv_budget(mc, EngineConfig(kv_cache_gb=2.5), 2, CUDA, h200(139)) == int(2.5 * GIB)
    assert kv_budget(mc, EngineConfig(), 4, torch.device("cpu")) == CPU_POOL_BYTES == GIB
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=37))
    assert eng.blocks.num_blocks == 37


def test_a_share_that_leaves_no_pool_is_refused_with_the_figures(embedded):
    with pytest.raises(SettingsError) as e:
        kv_budget(embedded.config, EngineConfig(gpu_memory_utilization=0.3), 2, CUDA, h200(98.5))
    assert str(e.value).startswith("gpu_memory_utilization 0.3 leaves no KV pool")
    assert "140.0 GiB, 41.5 GiB are in use and a step needs 0.99 GiB" in str(e.value)
    with pytest.raises(SettingsError, match=r"must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=0)
