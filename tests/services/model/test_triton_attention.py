"""The Triton paged attention (services/model/kernels/gpu/attention.py) against the torch reference:
the KV write byte for byte, decode split along long contexts, prefill chunks over cached
blocks, mixed batches, GQA groups 1, 3 and 8, head dims 64 and 128, both cache layouts.

On this CPU the kernels run in Triton's interpreter; PDSERVE_TEST_DEVICE=cuda runs the same
tests compiled on a GPU (bench/gpu_check.py does). Tolerances, the largest difference from
the reference allowed: float32 2e-6 (products in IEEE float32; the reference sums in other
orders); bfloat16 2^-6 absolute on outputs of size ~1 (two bfloat16 steps: the softmax
weights are rounded to bfloat16 before the value products, as in FlashAttention, and the
output once more).
"""

from __future__ import annotations

import pytest
import torch

from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.kernels import gpu
from services.model.kernels.gpu.attention import SPLIT_BLOCKS, TritonAttention, decode
from services.model.kernels.gpu.kv_write import write_kv
from services.model.layers.attention import TorchAttention
from tests.support.devices import test_device

DEVICE = test_device()
BLOCK = 16
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-6}

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU: run these with PDSERVE_TEST_DEVICE=cuda",
)


def _caches(dtype: torch.dtype, blocks: int, kv_heads: int, dim: int):
    k = torch.zeros(blocks, kv_heads, dim, BLOCK, dtype=dtype, device=DEVICE)
    v = torch.zeros(blocks, kv_heads, BLOCK, dim, dtype=dtype, device=DEVICE)
    return k, v


def _rows(n: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=gen).to(dtype).to(DEVICE)


def _prefilled(chunks, dtype, heads, kv_heads, dim, seed):
    """Caches (for Triton, for the reference) holding the chunks' K/V, written by the
    reference (the interpreter's time goes to the batches under test)."""
    reference = _caches(dtype, 32, kv_heads, dim)
    n = sum(len(c.token_ids) for c in chunks)
    q, k, v = (_rows(n, h, dim, dtype, seed + i) for i, h in enumerate((heads, kv_heads, kv_heads)))
    attn = TorchAttention()
    attn.forward(q, k, v, *reference, attn.plan(ForwardBatch.build(chunks, BLOCK, DEVICE)))
    return tuple(c.clone() for c in reference), reference


def _both(chunks, q, k, v, caches, reference_caches):
    """Triton's and torch's outputs for one batch; each writes its own copy of the cache."""
    batch = ForwardBatch.build(chunks, BLOCK, DEVICE)
    triton_attn, torch_attn = TritonAttention(), TorchAttention()
    got = triton_attn.forward(q, k, v, *caches, triton_attn.plan(batch))
    want = torch_attn.forward(q, k, v, *reference_caches, torch_attn.plan(batch))
    return got, want


# a long decode (two splits), a chunk over cached blocks crossing block edges, a fresh prompt
TABLE_A = [7, 3, 30, 12, 1, 25, 9, 14, 2, 28, 19, 4, 22, 17, 5, 26, 10, 31, 21, 8, 29]
TABLE_B = [11, 0, 27, 6]
TABLE_C = [13, 18, 23]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(2, 2, 64), (6, 2, 64), (8, 1, 128)])
def test_a_mixed_batch_equals_the_reference(dtype, heads, kv_heads, dim):
    long_context = SPLIT_BLOCKS * BLOCK + 37  # the decode spans two splits
    first = [SeqChunk([0] * long_context, 0, TABLE_A), SeqChunk([0] * 40, 0, TABLE_B)]
    caches, reference = _prefilled(first, dtype, heads, kv_heads, dim, 1)
    # then a mixed step: A decodes one token, B's chunk of 21 (positions 40..60), C whole (33)
    mixed = [SeqChunk([0], long_context, TABLE_A), SeqChunk([0] * 21, 40, TABLE_B),
             SeqChunk([0] * 33, 0, TABLE_C)]  # fmt: skip
    q, k, v = (_rows(55, h, dim, dtype, s) for h, s in ((heads, 4), (kv_heads, 5), (kv_heads, 6)))
    got, want = _both(mixed, q, k, v, caches, reference)
    assert torch.equal(caches[0], reference[0]) and torch.equal(caches[1], reference[1])
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_rows_alone_and_padding(dtype):
    """Decode-only batches take the batch's tensors as they are (what a CUDA graph replays);
    a padded row (slot -1, context 0) writes no KV and gets zeros."""
    heads, kv_heads, dim = 9, 3, 64
    prompts = [SeqChunk([0] * 50, 0, TABLE_B), SeqChunk([0] * 17, 0, TABLE_C)]
    caches, reference = _prefilled(prompts, dtype, heads, kv_heads, dim, 7)
    steps = [SeqChunk([0], 50, TABLE_B), SeqChunk([0], 17, TABLE_C)]
    q, k, v = (_rows(2, h, dim, dtype, s) for h, s in ((heads, 10), (kv_heads, 11), (kv_heads, 12)))
    got, want = _both(steps, q, k, v, caches, reference)
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]
    # one split is normalised and written by the decode kernel itself; two (the second
    # empty) go through _combine: the same bits
    plan = TritonAttention().plan(ForwardBatch.build(steps, BLOCK, DEVICE))
    assert plan.splits == 1 and plan.decode is not None
    outs = [torch.full_like(q, 7.0).to(dtype) for _ in range(2)]
    for splits, out in zip((1, 2), outs, strict=True):
        decode(q.to(dtype).contiguous(), *caches, *plan.decode, splits, out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], got)

    before = tuple(c.clone() for c in caches)
    pad = torch.tensor([-1], device=DEVICE)
    write_kv(k[:1], v[:1], *caches, pad)
    assert torch.equal(before[0], caches[0]) and torch.equal(before[1], caches[1])
    rows, lens = torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE)
    tables = torch.zeros(1, 4, dtype=torch.int64, device=DEVICE)
    for splits in (1, 2):
        out = torch.full_like(q[:1].to(dtype), 7.0)
        decode(q[:1].to(dtype).contiguous(), *caches, rows, tables, lens, splits, out)
        assert torch.equal(out, torch.zeros_like(out)), splits


def test_the_write_lays_out_both_cache_layouts_as_kv_cache_write():
    """float32 keeps plain blocks, bfloat16 pairs (kv_cache.py): the same bytes as the
    reference's write for every slot of a block and across block edges."""
    for dtype in (torch.float32, torch.bfloat16):
        caches = _caches(dtype, 6, 2, 64)
        reference = tuple(c.clone() for c in caches)
        slots = torch.tensor([0, 1, 15, 16, 17, 33, 95, 47], device=DEVICE)
        k, v = _rows(8, 2, 64, dtype, 13), _rows(8, 2, 64, dtype, 14)
        write_kv(k, v, *caches, slots)
        kv_cache.write(*reference, slots, k, v)
        assert torch.equal(caches[0], reference[0]) and torch.equal(caches[1], reference[1])
