"""The C decode-attention kernel against the torch reference path, and the cache layout."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from services.model import kernels, kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.layers.attention import CpuAttention, TorchAttention, default_attention

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


def test_bfloat16_blocks_hold_pairs_and_move_in_the_plain_layout():
    """A bfloat16 cache keeps a block's elements in pairs (what VDPBF16PS takes): K's dimensions
    2j and 2j + 1 of a token side by side, V's tokens 2j and 2j + 1 of a dimension side by side.
    Whole blocks leave and enter it (store export and import) in the plain layout, the same
    bytes a float32 cache's blocks convert to."""
    config = ModelConfig("llama", 8, 72, 8, 2, 6, 3, 12, 1e-5, 1e4, 64, True, False)
    gen = torch.Generator().manual_seed(3)
    caches = {dt: KVCache(config, 4, BLOCK, dt) for dt in (torch.float32, torch.bfloat16)}
    k, v = torch.randn(2, 40, 3, 12, generator=gen), torch.randn(2, 40, 3, 12, generator=gen)
    k, v = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()  # exact in both dtypes
    table = [3, 0, 2]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(40)])
    for cache in caches.values():
        for layer in range(2):
            kv_cache.write(
                *cache.layer(layer), slots, k[layer].to(cache.k.dtype), v[layer].to(cache.v.dtype)
            )
    paired = caches[torch.bfloat16]
    raw_k, raw_v = paired.k[1, 0, 2].flatten(), paired.v[1, 0, 2].flatten()  # token 16 + t
    for t, d in [(0, 0), (5, 7), (15, 11)]:
        assert raw_k[d // 2 * 2 * BLOCK + 2 * t + d % 2] == k[1, 16 + t, 2, d]
        assert raw_v[t // 2 * 2 * 12 + 2 * d + t % 2] == v[1, 16 + t, 2, d]
    plain = [kv_cache.gather_blocks(c, table) for c in (caches[torch.float32], paired)]
    assert torch.equal(plain[0][0].to(torch.bfloat16), plain[1][0])
    assert torch.equal(plain[0][1].to(torch.bfloat16), plain[1][1])
    keys, _ = kv_cache.gather(*paired.layer(1), torch.tensor(table))
    assert torch.equal(keys[:40].float(), k[1])
    target = KVCache(config, 4, BLOCK, torch.bfloat16)
    kv_cache.scatter_blocks(target, [1, 2, 3], *plain[0])  # float32 blocks, converted
    assert torch.equal(target.k[:, 1:], paired.k[:, table])
    assert torch.equal(target.v[:, 1:], paired.v[:, table])


@needs_kernel
def test_the_tile_path_runs_where_a_probe_survived_and_the_setting_allows(monkeypatch):
    """AMX is used only where the library has it, a child process ran a tile product, and
    PDSERVE_AMX is not 0; the kernels tests above then run it (both kernels alike)."""
    assert LIBRARY is not None
    path, prefix = LIBRARY._name, "paged_attention_amx"
    try:
        kernels.amx_usable.cache_clear()
        monkeypatch.setenv("PDSERVE_AMX", "0")
        assert kernels.amx_usable(path, prefix) is False
        kernels.amx_usable.cache_clear()
        monkeypatch.delenv("PDSERVE_AMX")
        if not LIBRARY.paged_attention_amx_compiled():  # no AMX in this CPU or compiler
            assert kernels.amx_usable(path, prefix) is False
        assert CpuAttention(LIBRARY).amx == kernels.amx_usable(path, prefix)
    finally:
        kernels.amx_usable.cache_clear()
        LIBRARY.paged_attention_use_amx(int(kernels.amx_usable(path, prefix)))


def _largest_allocation(fn):  # type: ignore[no-untyped-def]
    """fn's result and the largest block of memory anything allocated while it ran (torch's
    allocator, as its profiler records it: allocations inside ops included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_leave_the_cache_without_copying_the_pool(dtype):
    """Gathering a few blocks (a finished request's write-back, a prefill's export) copies
    those blocks, never the pool: a select through the paired layout's strided views once made
    every write-back copy the whole cache (2.8 s for 4,000 blocks, on the engine thread)."""
    config = ModelConfig("llama", 8, 72, 8, 2, 6, 3, 12, 1e-5, 1e4, 64, True, False)
    cache = KVCache(config, 64, BLOCK, dtype)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    (k, v), largest = _largest_allocation(lambda: kv_cache.gather_blocks(cache, [9, 3, 40]))
    assert k.shape == (3, 2, 3, 12, BLOCK) and v.shape == (3, 2, 3, BLOCK, 12)
    assert largest == k.numel() * k.element_size()  # the three blocks' K, at most
    plain_k, _ = kv_cache.plain_views(cache.k, cache.v)
    assert torch.equal(k[1], plain_k[:, 3].flatten(-3, -2))
    k_layer, v_layer = cache.layer(1)
    (keys, _), largest = _largest_allocation(
        lambda: kv_cache.gather(k_layer, v_layer, torch.tensor([9, 3]))
    )
    assert keys.shape == (2 * BLOCK, 3, 12)
    assert largest == keys.numel() * keys.element_size()


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


@pytest.mark.all_cores  # (tests/conftest.py)
@needs_kernel
def test_kernel_result_does_not_depend_on_the_batch():
    q, k, v, kc, vc, batch = _setup(torch.float32)
    attn = CpuAttention(LIBRARY)
    together = attn.forward(q, k, v, kc.clone(), vc.clone(), attn.plan(batch))
    for i, span in enumerate(batch.seqs):
        one = ForwardBatch.build(
            [SeqChunk([0], span.context_len - 1, span.block_table.tolist())], BLOCK
        )
        alone = attn.forward(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], kc.clone(), vc.clone(), attn.plan(one)
        )
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


def _prefill_setup(dtype, specs, heads=9, kv_heads=3, dim=64):
    """Chunks (start, length): each sequence's first `start` tokens already cached (random
    K/V), then `length` new tokens; blocks scattered through the pool."""
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-(s + n) // BLOCK) for s, n in specs) + 2
    k_cache = torch.randn(blocks, kv_heads, dim, BLOCK, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, kv_heads, BLOCK, dim, generator=gen).to(dtype)
    perm = torch.randperm(blocks, generator=gen).tolist()
    chunks, used = [], 0
    for start, n in specs:
        need = -(-(start + n) // BLOCK)
        chunks.append(SeqChunk([0] * n, start, perm[used : used + need]))
        used += need
    batch = ForwardBatch.build(chunks, BLOCK)
    rows = batch.num_tokens
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, batch


# whole prompts, chunks after cached tokens (block-aligned or not), decodes among them
MIXED = [(0, 1), (0, 5), (0, 16), (0, 17), (16, 40), (256, 200), (3, 1), (100, 1), (0, 300),
         (37, 29)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 4e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (14, 2, 128), (4, 2, 16)]
)
def test_prefill_kernel_matches_torch(dtype, tol, heads, kv_heads, dim):
    q, k, v, kc, vc, batch = _prefill_setup(dtype, MIXED, heads, kv_heads, dim)
    reference, kernel = TorchAttention(), CpuAttention(LIBRARY)
    expected = reference.forward(q, k, v, kc.clone(), vc.clone(), reference.plan(batch))
    kc_kernel, vc_kernel = kc.clone(), vc.clone()
    got = kernel.forward(q, k, v, kc_kernel, vc_kernel, kernel.plan(batch))
    assert got.dtype == dtype
    assert (got.float() - expected.float()).abs().max().item() < tol
    reference.forward(q, k, v, kc, vc, reference.plan(batch))  # the same K/V written
    assert torch.equal(kc_kernel, kc) and torch.equal(vc_kernel, vc)


@pytest.mark.all_cores  # (tests/conftest.py)
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_do_not_depend_on_chunking_or_batch(dtype):
    """A prompt's rows are the same computed whole, as a later chunk, or among others."""
    q, k, v, kc, vc, batch = _prefill_setup(dtype, [(0, 300)])
    attn = CpuAttention(LIBRARY)
    whole = attn.forward(q, k, v, kc, vc, attn.plan(batch))  # the cache now holds all 300
    table = batch.seqs[0].block_table.tolist()
    tail = ForwardBatch.build([SeqChunk([0] * 44, 256, table)], BLOCK)
    alone = attn.forward(q[256:], k[256:], v[256:], kc, vc, attn.plan(tail))
    assert torch.equal(alone, whole[256:])
    others = [SeqChunk([0], 40, table[:3]), SeqChunk([0] * 44, 256, table),
              SeqChunk([0] * 7, 0, table[:1])]  # fmt: skip
    mixed = ForwardBatch.build(others, BLOCK)
    qm = torch.cat([q[40:41], q[256:], q[:7]])
    km, vm = torch.cat([k[40:41], k[256:], k[:7]]), torch.cat([v[40:41], v[256:], v[:7]])
    together = attn.forward(qm, km, vm, kc, vc, attn.plan(mixed))
    assert torch.equal(together[:1], whole[40:41])  # a decode row: the other kernel
    assert torch.equal(together[1:45], whole[256:])
    assert torch.equal(together[45:], whole[:7])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (14, 2, 128)])
def test_decoding_a_token_gives_the_bits_of_prefilling_it(dtype, heads, kv_heads, dim):
    """Every position of a prompt decoded alone (the decode kernel) equals its row of the
    prompt's prefill: what makes a cache hit that leaves one token to compute, and a migrated
    stream that recomputes its output as a chunk, give the tokens of a cold run."""
    q, k, v, kc, vc, batch = _prefill_setup(dtype, [(0, 200)], heads, kv_heads, dim)
    attn = CpuAttention(LIBRARY)
    whole = attn.forward(q, k, v, kc, vc, attn.plan(batch))
    table = batch.seqs[0].block_table.tolist()
    positions = list(range(200))
    decodes = ForwardBatch.build([SeqChunk([0], p, table) for p in positions], BLOCK)
    assert all(s.is_decode for s in decodes.seqs)
    decoded = attn.forward(q, k, v, kc, vc, attn.plan(decodes))
    assert torch.equal(decoded.view(torch.uint8), whole.view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_kv_like_the_reference_from_a_qkv_view(dtype):
    q, k, v, kc, vc, batch = _prefill_setup(dtype, [(5, 40), (0, 1), (16, 16)])
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # as the model has it
    v_view = qkv[:, -v[0].numel() :].view(v.shape)
    assert not v_view.is_contiguous()
    attn = CpuAttention(LIBRARY)
    kc_kernel, vc_kernel = kc.clone(), vc.clone()
    attn._write(k, v_view, kc_kernel, vc_kernel, batch.slot_mapping)
    kv_cache.write(kc, vc, batch.slot_mapping, k, v)
    assert torch.equal(kc_kernel, kc) and torch.equal(vc_kernel, vc)
