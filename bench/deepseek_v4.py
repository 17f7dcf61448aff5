"""DeepSeek-V4's cache and attention cost on the CPU, against latent attention (MLA) and per-head
K and V of the same width.

    python -m bench.deepseek_v4 [--dtype bfloat16] [--contexts 1024,...,16384] [--batches 1,32]

Two Markdown tables:

1. memory per token of context at 1k, 8k and 32k (exact, from the layouts: kv_cache.py and
   deepseek_v4/config.py row_layout), DeepSeek-V4-Flash's shape (43 layers: 2 sliding, 21
   CSA, 20 HCA) as pdserve keeps it (shares in blocks for good, window keys and compressor inputs in
   a cache group released as they leave every window: group_pool.py) and as it would with
   every window part kept, against an MLA model (DeepSeek-V3's latent, 512 + 64) and
   per-head K and V (32 heads x 128) of the same 43 layers;
2. one layer's decode step at each context and batch size (the attention alone: projections,
   compressors, indexer, attention, output projection), for V4's three layer types and an MLA
   layer of the same width (hidden 1,024, 16 heads; V4's head 512 with 64 rotary dims, the
   indexer 64 x 128 picking 512, a window of 128; MLA's latent 512 + 64). The caches are
   filled with random rows (every sequence of the batch reads the same blocks) rather than
   prefilled: only the step is timed.
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
from typing import Any

import torch

from bench import forward
from bench.deepseek import log
from services.model import families
from services.model.batch import ForwardBatch, SeqChunk
from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape, latent_cache
from services.model.families.deepseek.mla import MlaWeights
from services.model.families.deepseek.model import DeepseekModel
from services.model.families.deepseek_v4.config import (
    CSA,
    HCA,
    SLIDING,
    row_layout,
    v4_of,
    window_keep,
)
from services.model.families.deepseek_v4.model import DeepseekV4Model
from services.model.families.deepseek_v4.rows import Pools
from services.model.loader import cpu_has_bf16_units
from services.model.loading.hf_config import config_from_hf

FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)]  # V4-Flash's layers
WIDTH = dict(
    vocab_size=256,
    hidden_size=1024,
    num_attention_heads=16,
    head_dim=512,
    q_lora_rank=512,
    o_groups=4,
    o_lora_rank=512,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    moe_intermediate_size=16,
    n_routed_experts=1,
    num_experts_per_tok=1,
    max_position_embeddings=65536,
    qk_rope_head_dim=64,
)


def v4_config(ratios: list[int], **shape: Any) -> ModelConfig:
    raw = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": len(ratios),
           "compress_ratios": ratios, "mlp_layer_types": ["moe"] * len(ratios)}  # fmt: skip
    return config_from_hf(raw | shape)


def memory_table(contexts: tuple[int, ...] = (1024, 8192, 32768)) -> str:
    """Cache bytes per token of context (bfloat16), averaged over the context."""
    flash = v4_config(
        FLASH_RATIOS,
        hidden_size=4096,
        num_attention_heads=64,
        vocab_size=129280,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=6,
    )
    rows = row_layout(v4_of(flash), flash.head_dim)
    window = sum(r.kv + r.raw for r in rows) * 2  # bytes a token while in the window
    share = sum(r.share for r in rows) * 2  # bytes a token keeps

    def whole(n: int) -> float:
        return window + share

    def released(n: int) -> float:
        """Whole blocks: every block's shares, the window blocks a sequence still holds."""
        blocks = -(-n // 16)
        first = max(0, (n - window_keep(v4_of(flash))) // 16)  # GroupPool.slide
        return (blocks * 16 * share + (blocks - first) * 16 * window) / n

    mla = 43 * (512 + 64) * 2
    per_head = 43 * 2 * 32 * 128 * 2
    lines = [
        "| cache (bfloat16) | "
        + " | ".join(f"{n // 1024}k: bytes / token" for n in contexts)
        + " |",
        "| --- |" + " ---: |" * len(contexts),
    ]
    for label, fn in (
        ("DeepSeek-V4-Flash, every window part kept", whole),
        ("DeepSeek-V4-Flash, pdserve (window blocks released)", released),
        ("MLA latent (512 + 64), 43 layers", lambda n: mla),
        ("per-head K and V (32 x 128), 43 layers", lambda n: per_head),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{fn(n):,.0f}" for n in contexts) + " |")
    lines.append(
        f"\nV4-Flash per token: {window:,} bytes of window keys and compressor inputs, "
        f"{share:,} of compressed entries (shares)"
    )
    return "\n".join(lines)


def _random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in families.expected_shapes(config).items():
        if name.endswith("tid2eid"):
            out[name] = torch.zeros(shape, dtype=torch.int64)
        elif "norm" in name or name.endswith("scale"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=g) * 0.02
    return out


def _decode_batch(context: int, batch: int, blocks: int) -> ForwardBatch:
    table = list(range(blocks))
    return ForwardBatch.build([SeqChunk([1], context, table) for _ in range(batch)], 16)


def v4_step(
    kind: str, dtype: torch.dtype, contexts: list[int], batches: list[int], repeats: int
) -> list[float]:
    ratio = {SLIDING: 0, CSA: 4, HCA: 128}[kind]
    config = v4_config([ratio], **WIDTH)
    model = DeepseekV4Model(config, _random_weights(config), dtype)
    layer = model.layers[0].attention
    times = []
    for n in contexts:
        blocks = math.ceil((n + 1) / 16)
        kv = model.new_kv_cache(blocks, 16)
        for group in kv.groups:  # random rows: entries' shares, window keys, compressor inputs
            group.k.normal_()
        for b in batches:
            batch = _decode_batch(n, b, blocks)
            x = torch.randn(b, config.hidden_size).to(dtype)
            step = functools.partial(model.attention.forward, 0, layer, x, batch, Pools.of(kv))
            with torch.inference_mode():
                times.append(forward.best_of(repeats, step))
            log(f"{kind} n={n} b={b}: {times[-1] * 1e3:.1f} ms")
    return times


def mla_step(dtype: torch.dtype, contexts: list[int], batches: list[int], repeats: int) -> list:
    base = dict(
        architecture="deepseek_v3",
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=16,
        num_layers=1,
        num_heads=16,
        num_kv_heads=16,
        head_dim=192,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    shape = MlaShape(q_lora_rank=512, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128)
    config = ModelConfig(**base, shape=shape, cache=latent_cache(1, shape))  # type: ignore[arg-type]
    model = DeepseekModel(config, _random_weights(config), dtype)
    layer = model.layers[0].attention
    assert isinstance(layer, MlaWeights)
    times = []
    for n in contexts:
        blocks = math.ceil((n + 1) / 16)
        kv = model.new_kv_cache(blocks, 16)
        kv.k.normal_()
        k_cache, v_cache = kv.layer(0)
        for b in batches:
            batch = _decode_batch(n, b, blocks)
            x = torch.randn(b, config.hidden_size).to(dtype)
            plan, at = model.mla.plan(batch), model.mla_rotary.tables(batch.positions)
            step = functools.partial(model.mla.forward, layer, x, at, k_cache, v_cache, plan)
            with torch.inference_mode():
                times.append(forward.best_of(repeats, step))
            log(f"mla n={n} b={b}: {times[-1] * 1e3:.1f} ms")
    return times


def step_table(dtype: str, contexts: list[int], batches: list[int], repeats: int) -> str:
    d = forward.DTYPES[dtype]
    columns = [(n, b) for n in contexts for b in batches]
    rows = {kind: v4_step(kind, d, contexts, batches, repeats) for kind in (SLIDING, CSA, HCA)}
    rows["MLA (V3-style latent)"] = mla_step(d, contexts, batches, repeats)
    head = "| layer (ms a decode step) | " + " | ".join(f"{n // 1024}k b={b}" for n, b in columns)
    lines = [head + " |", "| --- |" + " ---: |" * len(columns)]
    for kind, times in rows.items():
        lines.append(f"| {kind} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16" if cpu_has_bf16_units() else "float32")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="memory,step", help="which tables")
    args = p.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    if "memory" in args.only:
        print("\n" + memory_table())
    if "step" in args.only:
        contexts = [int(n) for n in args.contexts.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
        print(f"\none layer's decode step, {args.dtype}\n")
        print(step_table(args.dtype, contexts, batches, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
