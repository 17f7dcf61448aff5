"""The C decode-attention kernel against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from services.model import kernels
from services.model.attention import CpuAttention, TorchAttention
from services.model.batch import ForwardBatch, SeqChunk

BLOCK = 16
LIBRARY = kernels.load("paged_attention")
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler here")


def _setup(dtype, heads=9, kv_heads=3, dim=64, lengths=(1, 5, 16, 17, 130, 700)):
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-n // BLOCK) for n in lengths) + 3
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
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


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (14, 2, 128)])
def test_kernel_matches_torch(dtype, tol, heads, kv_heads, dim):
    q, k, v, kc, vc, batch = _setup(dtype, heads, kv_heads, dim)
    reference, kernel = TorchAttention(), CpuAttention(LIBRARY)
    expected = reference.forward(q, k, v, kc.clone(), vc.clone(), reference.plan(batch))
    got = kernel.forward(q, k, v, kc, vc, kernel.plan(batch))
    assert got.dtype == dtype
    assert (got.float() - expected.float()).abs().max().item() < tol


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
