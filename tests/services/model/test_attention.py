"""The C decode-attention kernel against the torch reference path, and the cache layout."""

from __future__ import annotations

import pytest
import torch

from services.model import kernels, kv_cache
from services.model.attention import CpuAttention, TorchAttention, default_attention
from services.model.batch import ForwardBatch, SeqChunk

BLOCK = 16
LIBRARY = kernels.load("paged_attention")
needs_kernel = pytest.mark.skipif(LIBRARY is None, reason="no C compiler here")


def _setup(dtype, heads=9, kv_heads=3, dim=64, lengths=(1, 5, 16, 17, 130, 700)):
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-n // BLOCK) for n in lengths) + 3
    k_cache = torch.randn(blocks, kv_heads, dim, BLOCK, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, kv_heads, BLOCK, dim, generator=gen).to(dtype)
    perm = torch.randperm(blocks, generator=gen).tolist()  # scattered block tables
    chunks, used = [], 0
    for n in lengths:  # every sequence decodes its n-th token; K/V before it already cached
        need = -(-n // BLOCK)
        chunks.append(SeqChunk([0], n - 1, perm[used : used + need]))
        used += need
    batch = ForwardBatch.build(chunks, BLOCK)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    k = torch.randn(len(lengths), kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(len(lengths), kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, batch


def test_write_then_gather_round_trips_in_token_order():
    k_cache, v_cache = torch.zeros(5, 3, 4, BLOCK), torch.zeros(5, 3, BLOCK, 4)
    k, v = torch.randn(40, 3, 4), torch.randn(40, 3, 4)
    table = [3, 0, 4]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(40)])
    kv_cache.write(k_cache, v_cache, slots, k, v)
    keys, values = kv_cache.gather(k_cache, v_cache, torch.tensor([table, table]))
    assert keys.shape == (2, 48, 3, 4)
    assert torch.equal(keys[1, :40], k) and torch.equal(values[0, :40], v)
    assert torch.equal(k_cache[0, 2, :, 5], k[16 + 5, 2])  # K transposed within its block


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (14, 2, 128)])
def test_kernel_matches_torch(dtype, tol, heads, kv_heads, dim):
    q, k, v, kc, vc, batch = _setup(dtype, heads, kv_heads, dim)
    reference, kernel = TorchAttention(), CpuAttention(LIBRARY)
    expected = reference.forward(q, k, v, kc.clone(), vc.clone(), reference.plan(batch))
    got = kernel.forward(q, k, v, kc, vc, kernel.plan(batch))
    assert got.dtype == dtype
    assert (got.float() - expected.float()).abs().max().item() < tol


@needs_kernel
def test_kernel_result_does_not_depend_on_the_batch():
    q, k, v, kc, vc, batch = _setup(torch.float32)
    attn = CpuAttention(LIBRARY)
    together = attn.forward(q, k, v, kc.clone(), vc.clone(), attn.plan(batch))
    for i, span in enumerate(batch.seqs):
        one = ForwardBatch.build(
            [SeqChunk([0], span.context_len - 1, span.block_table.tolist())], BLOCK
        )
        alone = attn.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], kc.clone(), vc.clone(),
                             attn.plan(one))  # fmt: skip
        assert torch.equal(alone[0], together[i])


@needs_kernel
def test_kernel_only_for_shapes_it_takes():
    cpu = torch.device("cpu")
    assert isinstance(default_attention(cpu, torch.float32, 64, 3), CpuAttention)
    assert isinstance(default_attention(cpu, torch.bfloat16, 128, 16), CpuAttention)
    # not a whole number of vectors; past the kernel's arrays; too many heads per KV head
    for head_dim, group in ((36, 3), (264, 1), (64, 32)):
        assert type(default_attention(cpu, torch.float32, head_dim, group)) is TorchAttention
    assert type(default_attention(cpu, torch.float16, 64, 3)) is TorchAttention
