"""DeepSeek-V3's (or V4's) MTP layer as the speculative proposer (`--speculative mtp`), against
n-gram drafting and none, in one run.

    python -m bench.mtp [--dtype bfloat16] [--tokens 64] [--prompts 4] [--family v3|v4]

Two random checkpoints of bench.deepseek's width (hidden 1,024, MLA 512 + 64, 32 experts top 4
of 4 groups, one shared), each with one MTP layer, made once with transformers:
- `copy`: 8 MoE layers of which only the first changes the residual, its MTP layer a copy
  of that one (save_with_mtp: it drafts what the target computes one position on, at an
  eighth of its cost): the best case, acceptance near 1;
- `random`: bench.deepseek's 8 layers and a random MTP layer: acceptance near 0, so what
  drafting costs when it wins nothing (the adaptive length falls to 1 and pauses).
`--family v4`: the same two at DeepSeek-V4's shape (V4_SHAPE; v4_checkpoint, write_v4_mtp).
Random-token prompts, greedy: every configuration's tokens are the same (checked). One stream,
then `--prompts` concurrent streams (the default speculative_max_batch, 4, lets them all
propose). A Markdown table: tokens/s, the ratio to none, tokens proposed and accepted.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

from bench.deepseek import SHAPE, log
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import LoadedModel, cpu_has_bf16_units, load_model, load_mtp
from services.model.loading import hf_dir
from services.model.loading.sources import EMBEDDED, cache_root, resolve
from services.settings import SpeculativeConfig


def save_with_mtp(
    config: transformers.DeepseekV3Config, path: Path, embedded_dir: Path, copy: bool
) -> None:
    """A DeepSeek-V3 checkpoint with one MTP layer (`num_nextn_predict_layers` 1, weights
    `model.layers.{N}.*` in a file of their own, as DeepSeek ships them).

    copy=False: the MTP layer's weights random (drawn around the last layer's spread).
    copy=True: the MTP layer repeats the target's first layer and every later layer passes the
    residual through (its output projections zero: it costs what it did, and adds nothing), so
    that the layer drafts what the target computes one position on: eh_proj passes the
    token's embedding through ([I | 0]; rows of RMS 1, so enorm keeps them), the shared head
    is the target's norm and head. It misses only the first token of the context: acceptance
    is high, not total; and it costs 1 / num_hidden_layers of the target, as a real one."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config.num_nextn_predict_layers = 1
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n, hidden = config.num_hidden_layers, config.hidden_size
    with torch.no_grad():
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
        embed = model.model.embed_tokens.weight
        if copy:
            embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
            for name, p in model.named_parameters():
                later = name.startswith("model.layers.") and not name.startswith("model.layers.0.")
                if later and ("o_proj" in name or "down_proj" in name):
                    p.zero_()
    model.save_pretrained(path)
    state: dict[str, torch.Tensor] = {}  # the hub's names (experts one by one)
    for file in hf_dir.safetensors_files(path):
        state |= load_file(str(file))
    source = "model.layers.0." if copy else f"model.layers.{n - 1}."
    mtp = {
        f"model.layers.{n}.{name.removeprefix(source)}": t.clone()
        if copy
        else t.clone().normal_(0, float(t.float().std()) or 0.02)
        for name, t in state.items()
        if name.startswith(source)
    }
    own = f"model.layers.{n}."
    eh = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    mtp |= {
        own + "enorm.weight": torch.ones(hidden),
        own + "hnorm.weight": torch.ones(hidden),
        own + "eh_proj.weight": eh if copy else torch.randn(hidden, 2 * hidden) * 0.05,
        own + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        own + "shared_head.norm.weight": state["model.norm.weight"].clone(),
        own + "shared_head.head.weight": state["lm_head.weight"].clone(),
    }
    add_shard(path, mtp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / name, path / name)


# DeepSeek-V4 at the same width: 8 layers (sliding, then CSA / HCA alternating; top-k experts
# after the first, hashed, except in the `copy` model's first), 4 streams, a 128-token window
V4_SHAPE = dict(
    vocab_size=49152,
    hidden_size=1024,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=512,
    q_lora_rank=768,
    qk_rope_head_dim=64,
    n_routed_experts=32,
    num_experts_per_tok=4,
    o_groups=4,
    o_lora_rank=512,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=256,
    sliding_window=128,
    max_position_embeddings=4096,
    layer_types=[
        "sliding_attention",
        *["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
        "sliding_attention",
    ],
)
SLIDING_MOE = dict(layer_types=["sliding_attention"], mlp_layer_types=["moe"])


def write_v4_mtp(path: Path, source: dict[str, torch.Tensor], copy: bool) -> None:
    """DeepSeek-V4's MTP layer added to the checkpoint transformers saved at `path` (as
    DeepSeek ships it: `mtp.0.*` in a file of its own, an index over both). Its block, hc_head
    and norm are `source`'s, a saved one-layer V4 (sliding attention, top-k experts): copy, the
    target's own (e_proj = I, h_proj = 0: it computes what the target's first layer computes
    for the next token); else random mixes (e_proj, h_proj ~ N(0, 1 / hidden))."""

    hidden = int(source["model.norm.weight"].shape[0])
    g = torch.Generator().manual_seed(2)
    mtp = {
        "mtp.0." + k.removeprefix("model.layers.0."): t.clone()
        for k, t in source.items()
        if k.startswith("model.layers.0.")
    }
    mtp |= {f"mtp.0.hc_head_{k}": source[f"model.hc_head.hc_{k}"] for k in ("fn", "base", "scale")}
    mtp |= {
        "mtp.0.norm.weight": source["model.norm.weight"],
        "mtp.0.enorm.weight": torch.ones(hidden),
        "mtp.0.hnorm.weight": torch.ones(hidden),
        "mtp.0.e_proj.weight": torch.eye(hidden)
        if copy
        else torch.randn(hidden, hidden, generator=g) / hidden**0.5,
        "mtp.0.h_proj.weight": torch.zeros(hidden, hidden)
        if copy
        else torch.randn(hidden, hidden, generator=g) / hidden**0.5,
    }
    add_shard(path, mtp)


def add_shard(path: Path, mtp: dict[str, torch.Tensor]) -> None:
    """The MTP layer's tensors in a file of their own beside the checkpoint at `path`, an index
    naming both, as DeepSeek ships them (transformers reads an index only where no
    model.safetensors is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / "model-mtp.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        listed = json.loads(index.read_text())
    else:
        (path / "model.safetensors").rename(path / "model-main.safetensors")
        with safe_open(str(path / "model-main.safetensors"), framework="pt") as f:
            names = list(f.keys())
        listed = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-main.safetensors")}
    listed["weight_map"] |= dict.fromkeys(mtp, "model-mtp.safetensors")
    index.write_text(json.dumps(listed))


def v4_checkpoint(kind: str) -> Path:
    """bench's V4 with an MTP layer. copy: every layer after the first passes the streams
    through (its outputs zero, its stream mix the identity: it costs what it did and adds
    nothing) and the MTP layer repeats the first (write_v4_mtp), over embedding rows of RMS 1:
    it drafts what the target computes next at an eighth of its cost. random: the MTP layer
    random, the target's layers too."""
    from safetensors.torch import load_file

    path = cache_root() / "bench" / f"deepseek-v4-mtp-{kind}"
    if (path / "config.json").is_file():
        return path
    log(f"making {path} (random weights, once)")
    hashed = ["moe"] if kind == "copy" else ["hash_moe"]
    config = transformers.DeepseekV4Config(**V4_SHAPE, mlp_layer_types=hashed + ["moe"] * 7)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = config.hc_mult
    with torch.no_grad():
        if kind == "copy":
            embed = model.get_input_embeddings().weight
            embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
            for name, p in model.named_parameters():
                if name.startswith("model.layers.0."):
                    continue
                if name.endswith(("o_b_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.zero_()
                if name.endswith("_hc.base"):  # comb: softmax of 50 on the diagonal
                    p[2 * n :] = 50 * torch.eye(n).flatten()
                if name.endswith("_hc.scale"):
                    p[2] = 0.0
    tmp = path.with_suffix(".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    source_dir = tmp / "mtp-source"
    if kind == "copy":
        source_dir = tmp
    else:
        torch.manual_seed(1)
        one = transformers.DeepseekV4Config(**(V4_SHAPE | SLIDING_MOE | {"num_hidden_layers": 1}))
        transformers.AutoModelForCausalLM.from_config(one).save_pretrained(source_dir)
    source: dict[str, torch.Tensor] = {}
    for file in hf_dir.safetensors_files(source_dir):
        source |= load_file(str(file))
    if kind != "copy":
        shutil.rmtree(source_dir)
    write_v4_mtp(tmp, source, copy=kind == "copy")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve(EMBEDDED) / name, tmp / name)
    tmp.rename(path)
    return path


def checkpoint(kind: str) -> Path:
    path = cache_root() / "bench" / f"deepseek-v3-mtp-{kind}"
    if (path / "config.json").is_file():
        return path
    log(f"making {path} (random weights, once)")
    config = transformers.DeepseekV3Config(**SHAPE, topk_method="noaux_tc")
    if kind == "copy":  # every layer MoE, as the first (copied) one
        config.first_k_dense_replace = 0
    tmp = path.with_suffix(".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_with_mtp(config, tmp, resolve(EMBEDDED), copy=kind == "copy")
    tmp.rename(path)
    return path


def run(loaded: LoadedModel, method: str, prompts: list[list[int]], tokens: int):
    """(tokens of each prompt, seconds, stats or None)."""
    draft = None
    if method == "mtp":
        m = loaded.model
        draft = load_mtp(loaded.path, loaded.config, m.dtype, m.device, m.kernels)
    spec = SpeculativeConfig(method if method != "none" else "none", num_tokens=3)
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(num_blocks=1024, speculative=spec), draft=draft
    )
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    if engine.speculator is not None:
        engine.speculator.stats = type(engine.speculator.stats)()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = engine.speculator.stats if engine.speculator is not None else None
    return [o.choices[0].token_ids for o in out], seconds, stats


def table(dtype: str, tokens: int, concurrent: int, family: str = "v3") -> str:
    rows = [
        "| checkpoint | streams | method | tokens/s | vs none | proposed | accepted "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (64,), generator=g).tolist() for _ in range(concurrent)]
    for kind in ("copy", "random"):
        path = checkpoint(kind) if family == "v3" else v4_checkpoint(kind)
        loaded = load_model(str(path), dtype=dtype, device="cpu")
        for streams in (1, concurrent):
            base: tuple | None = None
            for method in ("none", "ngram", "mtp"):
                log(f"{kind}: {streams} stream(s), {method}")
                out, seconds, stats = run(loaded, method, prompts[:streams], tokens)
                rate = streams * tokens / seconds
                base = base or (out, rate)
                proposed = accepted = ""
                if stats is not None:
                    share = stats.accepted / max(stats.proposed, 1)
                    proposed, accepted = f"{stats.proposed}", f"{stats.accepted} ({share:.0%})"
                rows.append(
                    f"| {kind} | {streams} | {method} | {rate:.1f} | "
                    f"{rate / base[1]:.2f}x | {proposed} | {accepted} | "
                    f"{out == base[0]} |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16" if cpu_has_bf16_units() else "float32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--family", choices=("v3", "v4"), default="v3", help="DeepSeek-V3 or V4")
    a = p.parse_args(argv)
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{a.dtype}, DeepSeek-{a.family.upper()}\n"
    )
    print(table(a.dtype, a.tokens, a.prompts, a.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
