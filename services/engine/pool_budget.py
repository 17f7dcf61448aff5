"""The KV pool's bytes, when `--num-blocks` does not fix its size.

`--kv-cache-gb` gives them. Otherwise, on a CPU, 1 GiB; on CUDA (as vLLM's
`--gpu-memory-utilization`) the worker may use that share of the device's memory: the pool
gets it less what the device already holds when the engine starts (the weights, CUDA's
context, other processes') and what one step needs besides (its activations, estimated from
the model's shapes and the step's token budget, and the CUDA graphs' memory).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.model.config import ModelConfig
from services.settings import EngineConfig
from services.settings.sections import GIB, SettingsError

CPU_POOL_BYTES = GIB
GRAPH_BYTES = 512 << 20  # CUDA graphs' private pool, at most (one per batch-size bucket)
MemInfo = Callable[[torch.device], tuple[int, int]]  # (free, total): torch.cuda.mem_get_info


def step_bytes(mc: ModelConfig, config: EngineConfig, itemsize: int) -> int:
    """A step's transient tensors, at most: per token the attention's and the MLP's rows (a
    MoE's chosen experts and shared ones), twice over (an input and an output alive at once);
    the logits in float32 with the sampler's float64 working copies, for every row (scoring a
    prompt returns them all)."""
    moe = mc.moe
    mlp = mc.intermediate_size
    if moe is not None:
        mlp = max(mlp, moe.top_k * moe.intermediate_size + moe.shared_intermediate_size)
    row = 3 * mlp + 8 * mc.hidden_size + mc.q_size + 2 * mc.kv_size
    tokens = config.max_num_batched_tokens
    return 2 * tokens * row * itemsize + tokens * mc.vocab_size * (4 + 8 + 8)


def kv_budget(
    mc: ModelConfig,
    config: EngineConfig,
    itemsize: int,
    device: torch.device,
    mem_get_info: MemInfo | None = None,
) -> int:
    """Bytes for the KV pool (`--num-blocks` unset)."""
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * GIB)
    if device.type != "cuda":
        return CPU_POOL_BYTES
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    share = config.gpu_memory_utilization
    held = total - free
    need = step_bytes(mc, config, itemsize) + (GRAPH_BYTES if config.cuda_graph_max_batch else 0)
    budget = int(share * total) - held - need
    if budget <= 0:
        raise SettingsError(
            f"gpu_memory_utilization {share:g} leaves no KV pool: of the device's "
            f"{total / GIB:.1f} GiB, {held / GIB:.1f} GiB are in use and a step needs "
            f"{need / GIB:.2f} GiB; raise it, or give --kv-cache-gb or --num-blocks"
        )
    return budget
