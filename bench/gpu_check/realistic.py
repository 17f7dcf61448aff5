"""Section 6: realistic sizes, made on the device: decode against the memory-bound limit, a
batch's tokens/s and a long prefill against transformers'.

Two random-weight checkpoints are built on the device by the transformers in use (in the dtype
`--dtype auto` picks there): a Llama-3-8B-shaped dense model and a DeepSeek-V3-shaped MoE with
two layers (DeepSeek-V3's widths: MLA 128 heads over a 512 + 64 latent, 256 routed experts
of 2,048, 8 per token, one shared; one dense layer and one MoE layer: 13.9B parameters, 28 GB
in bfloat16, the MoE layer's experts 11.3B). For each:

1. transformers' prefill of one `prefill_len`-token prompt (`generate`, one new token; one
   untimed run first), on the model just built;
2. the checkpoint saved (under DIR/realistic, removed after) and transformers' model freed;
3. the engine loads it, and times the same prefill, decode at `realistic_batches` (batch 1
   and 64), and one prompt's first greedy tokens beside transformers' (recorded: random
   bfloat16 weights have near ties);
4. the memory-bound limit of batch-1 decode: the bytes a step must read (every weight but the
   embedding, of each MoE layer's routed experts only the `num_experts_per_tok` a token uses)
   over the device's bandwidth, measured by copying a large buffer.

Pass: everything measured (the ratios are reported, not judged). `--dry` builds the same
architectures at tiny widths (the CPU suite's run).
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import torch

from bench.gpu_check.check import Check
from bench.gpu_check.parity import first_divergence, hf_generate
from bench.gpu_check.throughput import engine_decode, engine_prefill, hf_generate_seconds
from bench.offline import log, workload
from services.model.loader import load_model, resolve_dtype
from services.model.loading.sources import EMBEDDED, resolve

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
DEEPSEEK_V3 = dict(  # DeepSeek-V3's own widths; 2 layers (1 dense, 1 MoE) instead of 61
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8,
    n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192,
    routed_scaling_factor=2.5, tie_word_embeddings=False,
)  # fmt: skip
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SHAPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # name: (config class, full, dry)
    "llama3-8b": ("LlamaConfig", LLAMA3_8B,
                  TINY | dict(num_attention_heads=4, num_key_value_heads=2)),
    "deepseek-v3-2l": ("DeepseekV3Config", DEEPSEEK_V3,
                       DEEPSEEK_V3 | TINY | dict(num_hidden_layers=3, moe_intermediate_size=32,
                       n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                       num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                       kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                       v_head_dim=16)),
}  # fmt: skip
FIRST_TOKENS = 4  # greedy tokens of one prompt, the engine beside transformers


def bandwidth(check: Check) -> float:
    """Bytes per second the device copies (read + write), from a buffer well past its caches."""
    size = 64 * 2**20 if check.dry else 2 * 2**30
    src = torch.empty(size, dtype=torch.uint8, device=check.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        check.sync()
        start = time.perf_counter()
        dst.copy_(src)
        check.sync()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * size / best


def step_bytes(hf: Any, config: Any) -> int:
    """Bytes a batch-1 decode step reads: every weight but the embedding (one row of it), of
    each MoE layer's routed experts the fraction one token uses."""
    share = getattr(config, "num_experts_per_tok", 1) / getattr(config, "n_routed_experts", 1)
    total = 0.0
    for name, p in hf.named_parameters():
        if "embed_tokens" in name:
            continue
        size = p.numel() * p.element_size()
        total += size * share if ".experts." in name else size
    return int(total)


def build(check: Check, name: str, dtype: torch.dtype) -> Any:
    import transformers

    kind, full, dry = SHAPES[name]
    config = getattr(transformers, kind)(**(dry if check.dry else full))
    torch.manual_seed(0)
    with torch.device(check.device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return hf.eval()


def save(hf: Any, path: Any) -> None:
    """The checkpoint, with the embedded tokenizer's files (token ids are all the check sends),
    and the router's method as DeepSeek's own config.json says it."""
    hf.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    if saved.get("model_type") == "deepseek_v3":
        saved |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
        (path / "config.json").write_text(json.dumps(saved, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve(EMBEDDED) / file, path / file)


def measure(check: Check, name: str, gbps: float) -> dict[str, Any]:
    sizes, dtype = check.sizes, resolve_dtype("auto", check.device)
    log(f"  {name}: building it on {check.device} ({dtype})")
    hf = build(check, name, dtype)
    params = sum(p.numel() for p in hf.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    read = step_bytes(hf, hf.config)
    n = sizes.prefill_len
    ids = torch.tensor(workload(1, n, n, seed=8), device=check.device)
    log(f"  {name}: transformers' prefill of {n} tokens")
    hf_generate_seconds(check, hf, ids, 1)  # warm
    theirs = hf_generate_seconds(check, hf, ids, 1)
    prompt = workload(1, 24, 24, seed=3)[0]
    reference = hf_generate(hf, prompt, FIRST_TOKENS, check.device)
    path = check.out / "realistic" / name
    try:
        log(f"  {name}: saving {params / 1e9:.2f}B parameters")
        save(hf, path)
        del hf
        check.free()
        log(f"  {name}: the engine")
        loaded = load_model(str(path), str(dtype).removeprefix("torch."), str(check.device))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    mine = engine_prefill(check, loaded)
    decode = {b: engine_decode(check, loaded, b).tok_s for b in sizes.realistic_batches}
    from bench.gpu_check.families import engine_tokens

    ours, _ = engine_tokens(loaded, [prompt], FIRST_TOKENS)
    del loaded
    check.free()
    limit = gbps / read
    first = min(sizes.realistic_batches)
    return {"parameters": params, "parameter_bytes": weight_bytes, "dtype": str(dtype),
            "step_bytes": read,
            "limit_tok_s": limit, "decode_tok_s": decode,
            "decode_vs_limit": decode[first] / limit,
            "prefill": {"tokens": n, "pdserve_s": mine, "transformers_s": theirs,
                        "ratio": theirs / mine},
            "first_divergence": first_divergence(ours[0], reference)}  # fmt: skip


def run(check: Check, numbers: dict[str, Any]) -> bool:
    gbps = bandwidth(check)
    numbers |= {"bandwidth_gb_s": gbps / 1e9, "models": {}}
    log(f"  bandwidth {gbps / 1e9:.0f} GB/s (copy)")
    for name in SHAPES:
        numbers["models"][name] = measure(check, name, gbps)
    return True


def summary(n: dict[str, Any]) -> str:
    parts = [f"copy {n['bandwidth_gb_s']:.0f} GB/s"]
    for name, m in n["models"].items():
        decode = ", ".join(f"b={b} {t:.1f}" for b, t in m["decode_tok_s"].items())
        p = m["prefill"]
        parts.append(
            f"{name} ({m['parameters'] / 1e9:.2f}B, {m['step_bytes'] / 1e9:.2f} GB a step): "
            f"decode tok/s {decode}, batch 1 at {100 * m['decode_vs_limit']:.0f}% of the "
            f"{m['limit_tok_s']:.1f} tok/s memory limit; prefill {p['tokens']} tokens "
            f"{1000 * p['pdserve_s']:.0f} ms (transformers {1000 * p['transformers_s']:.0f} ms, "
            f"{p['ratio']:.2f}x); first greedy divergence {m['first_divergence']}"
        )
    return "; ".join(parts)
