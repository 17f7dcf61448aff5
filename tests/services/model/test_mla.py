"""Latent attention: the C kernel against the torch reference (both forms), bit-identical rows
decoded, prefilled and batched, and the latent cache through blocks and the codec."""

from __future__ import annotations

import pytest
import torch

from kvstore.codec import BlockCodec, CodecError, StorageDtype
from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape, latent_cache
from services.model.families.deepseek.mla import (
    CpuMlaAttention,
    MlaAttention,
    MlaWeights,
    default_mla_attention,
    split_kv_b,
)
from services.model.kv_cache import KVCache, gather_blocks, scatter_blocks
from services.model.layers.attention import KERNEL_BLOCK_SIZE as BLOCK
from services.model.layers.layer_ops import TorchLayerOps
from services.model.layers.linear import make_linear, packed_linear_available
from services.model.layers.rope import Rotary

MLA = MlaShape(q_lora_rank=48, kv_lora_rank=64, nope_dim=16, rope_dim=16, v_dim=32)
CONFIG = ModelConfig(
    architecture="deepseek_v3",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=6,
    num_kv_heads=6,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    shape=MLA,
    cache=latent_cache(2, MLA),
)


def layer_weights(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> MlaWeights:
    g = torch.Generator().manual_seed(seed)
    heads, m, h = CONFIG.num_heads, MLA, CONFIG.hidden_size

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype=dtype, device=device)

    packed = packed_linear_available(torch.device(device), dtype)  # prepacked where it works
    k_up, v_up = split_kv_b(w(heads * (m.nope_dim + m.v_dim), m.kv_lora_rank), heads, m)
    return MlaWeights(
        qkv_a=make_linear(w(m.q_lora_rank + m.latent_dim, h), packed=packed),
        q_a_norm=1 + 0.1 * w(m.q_lora_rank),
        q_b=make_linear(w(heads * (m.nope_dim + m.rope_dim), m.q_lora_rank), packed=packed),
        kv_a_norm=1 + 0.1 * w(m.kv_lora_rank),
        kv_b=make_linear(
            torch.cat([torch.cat([k_up[i], v_up[i].t()]) for i in range(heads)]), packed=packed
        ),
        k_up=k_up,
        v_up=v_up,
        o=make_linear(w(h, heads * m.v_dim), packed=packed),
    )


def ops(dtype: torch.dtype, device: str = "cpu") -> TorchLayerOps:
    return TorchLayerOps(CONFIG, Rotary(CONFIG, dtype, torch.device(device)))


def cpu_attention(dtype: torch.dtype) -> CpuMlaAttention:
    attention = default_mla_attention(CONFIG, ops(dtype), torch.device("cpu"), dtype, "c")
    if not isinstance(attention, CpuMlaAttention):
        pytest.skip("the MLA C kernel does not build here")
    return attention


def run(attention: MlaAttention, layer, dtype, chunks, x_by_seq, kv: KVCache) -> torch.Tensor:
    """Attention outputs [T, hidden] of the chunks (their rows' inputs from x_by_seq)."""
    # a chunk's "tokens" name its sequence (seq_chunk): its rows' inputs come from x_by_seq
    x = torch.cat([x_by_seq[c.token_ids[0]][c.start : c.context_len] for c in chunks])
    batch = ForwardBatch.build(chunks, BLOCK, x.device)
    rotary = Rotary(CONFIG, dtype, x.device, MLA.rope_dim)
    k, v = kv.layer(0)
    return attention.forward(layer, x, rotary.tables(batch.positions), k, v, attention.plan(batch))


def seq_chunk(seq: int, start: int, n: int, blocks: list[int]) -> SeqChunk:
    return SeqChunk([seq] * n, start, blocks)  # the "tokens" only name the sequence


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_c_kernel_equals_the_torch_reference(dtype, tol):
    """A batch of a prefill chunk over a cached prefix, a whole prompt and decode rows: the
    absorbed form in C against the torch reference (expanded prefill, absorbed decode)."""
    layer = layer_weights(dtype)
    g = torch.Generator().manual_seed(1)
    x_by_seq = [torch.randn(80, CONFIG.hidden_size, generator=g).to(dtype) for _ in range(3)]
    outputs = []
    for attention in (cpu_attention(dtype), MlaAttention(CONFIG, ops(dtype))):
        kv = KVCache(CONFIG, 24, BLOCK, dtype)
        tables = [[3, 7, 1, 9, 11], [2, 4, 6], [5, 8, 10, 12, 13]]
        prefixes = [seq_chunk(0, 0, 37, tables[0]), seq_chunk(2, 0, 60, tables[2])]
        run(attention, layer, dtype, prefixes, x_by_seq, kv)
        chunks = [seq_chunk(0, 37, 25, tables[0]), seq_chunk(1, 0, 40, tables[1]),
                  seq_chunk(2, 60, 1, tables[2])]  # fmt: skip
        outputs.append(run(attention, layer, dtype, chunks, x_by_seq, kv).float())
    c_out, reference = outputs
    assert (c_out - reference).abs().max() <= tol * reference.abs().max()


@pytest.mark.all_cores  # (tests/conftest.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_decoded_prefilled_and_batched(dtype):
    attention, layer = cpu_attention(dtype), layer_weights(dtype)
    g = torch.Generator().manual_seed(2)
    x_by_seq = [torch.randn(70, CONFIG.hidden_size, generator=g).to(dtype) for _ in range(2)]
    table = [4, 1, 7, 2, 9]

    def last_row(chunks, prefix: int | None = None) -> torch.Tensor:
        kv = KVCache(CONFIG, 16, BLOCK, dtype)
        if prefix:
            run(attention, layer, dtype, [seq_chunk(0, 0, prefix, table)], x_by_seq, kv)
        out = run(attention, layer, dtype, chunks, x_by_seq, kv)
        return out[len(chunks[0].token_ids) - 1]

    whole = last_row([seq_chunk(0, 0, 65, table)])
    decoded = last_row([seq_chunk(0, 64, 1, table)], prefix=64)
    chunked = last_row([seq_chunk(0, 50, 15, table)], prefix=50)
    other = seq_chunk(1, 0, 33, [3, 5, 6])
    batched = last_row([seq_chunk(0, 64, 1, table), other], prefix=64)
    for got in (decoded, chunked, batched):
        assert torch.equal(got.view(torch.uint8), whole.view(torch.uint8))


def test_the_latent_cache_holds_576_elements_per_token_for_deepseek_v3():
    v3 = MlaShape(q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128)
    config = ModelConfig(
        **{
            **CONFIG.__dict__,
            "num_heads": 128,
            "num_kv_heads": 128,
            "head_dim": 192,
            "shape": v3,
            "cache": latent_cache(CONFIG.num_layers, v3),
        }
    )
    assert config.cache_shape == (1, 576, 0)
    per_head_kv = 2 * 128 * 128  # the same model with one K and V per head
    assert per_head_kv / config.cache_elements == pytest.approx(56.9, abs=0.05)
    cache = KVCache(config, 2, BLOCK, torch.bfloat16)
    assert cache.bytes_per_block == config.num_layers * BLOCK * 576 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_blocks_move_between_pools_and_through_the_codec(dtype):
    cache = KVCache(CONFIG, 8, BLOCK, dtype)
    g = torch.Generator().manual_seed(3)
    k, v = cache.layer(1)
    rows = torch.randn(40, 1, MLA.latent_dim, generator=g).to(dtype)
    slots = torch.tensor([5 * BLOCK + i for i in range(16)] + [2 * BLOCK + i for i in range(24)])
    kv_cache.write(k, v, slots, rows, rows.new_empty(40, 1, 0))
    blocks_k, blocks_v = gather_blocks(cache, [5, 2])
    assert blocks_k.shape == (2, CONFIG.num_layers, 1, MLA.latent_dim, BLOCK)
    assert blocks_v.numel() == 0
    layout = kv_cache.layout("m", str(dtype).removeprefix("torch."), BLOCK, CONFIG)
    assert (layout.num_kv_heads, layout.head_dim, layout.v_dim) == (1, MLA.latent_dim, 0)
    codec = BlockCodec(layout, StorageDtype.parse(str(dtype).removeprefix("torch.")))
    hashes = [bytes([i]) * 32 for i in range(2)]
    values = codec.encode_many(blocks_k, blocks_v, hashes, [16, 16])
    decoded = codec.decode_many(values, hashes, dtype)
    assert torch.equal(decoded.k, blocks_k) and decoded.v.numel() == 0
    other = KVCache(CONFIG, 8, BLOCK, dtype)
    scatter_blocks(other, [1, 6], decoded.k, decoded.v)
    assert torch.equal(gather_blocks(other, [1, 6])[0], blocks_k)
    # a per-head layout of the same width refuses them
    per_head = BlockCodec(layout.__class__(**{**layout.__dict__, "v_head_dim": None}), codec.dtype)
    with pytest.raises(CodecError, match="V head dim"):
        per_head.check(values[0], hashes[0])


def test_fp8_latent_blocks_round_trip_within_fp8_precision():
    cache = KVCache(CONFIG, 4, BLOCK, torch.float32)
    g = torch.Generator().manual_seed(4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    k, v = gather_blocks(cache, [0, 3])
    codec = BlockCodec(kv_cache.layout("m", "fp8_e4m3", BLOCK, CONFIG), StorageDtype.FP8_E4M3)
    hashes = [b"a" * 32, b"b" * 32]
    decoded = codec.decode_many(codec.encode_many(k, v, hashes, [16, 16]), hashes)
    assert (decoded.k - k).abs().max() <= 0.07 * k.abs().max()
    assert decoded.v.numel() == 0
