"""Tiny random checkpoints of the MoE and latent-attention families, made and saved by
transformers (no hub): what tests serve and compare with transformers token for token."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

VOCAB = 49152  # the embedded tokenizer's, so its files can be reused
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# DeepSeek's latent attention, small: 4 heads of 16 + 8 rotary dims, a 32-wide latent
MLA = dict(
    BASE,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
)
# YaRN (a 128-token original context stretched 4x to 512), which changes the result
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707,
    "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip

# DeepSeek-V4, small: every layer type (sliding, CSA every 4 tokens, HCA every 16: a block),
# both MoE kinds (hash, top-k), two residual streams, a window of 8 and a top-3 indexer with
# 16 heads (few exact ties: see v4_attention._top_k)
V4 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
    hc_mult=2,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    max_position_embeddings=1024,
    swiglu_limit=0.5,
)

FAMILIES = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **MLA,
        q_lora_rank=48,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
    ),
    # V3 with the lightning indexer: 8 heads of 16 pick 8 of the earlier tokens per query
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **MLA,
        q_lora_rank=48,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=8,
    ),
    # every layer dense, rotate-half rotary
    "deepseek_v3_dense": lambda: transformers.DeepseekV3Config(
        **MLA,
        q_lora_rank=48,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=3,
        rope_interleave=False,
    ),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **MLA,
        q_lora_rank=None,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **BASE, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **BASE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **BASE,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "qwen3": lambda: transformers.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True),
    "deepseek_v4": lambda: transformers.DeepseekV4Config(**V4),
    # sliding (a window of 8) and full layers alternating, sinks, biased experts, YaRN
    "gpt_oss": lambda: transformers.GptOssConfig(
        **BASE,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
    # local (window 8) and global layers, the logits' softcap
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **BASE,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
    ),
}
ARCHITECTURE = {"deepseek_v3_dense": "deepseek_v3", "gemma3": "gemma3_text"}


def save_tiny(name: str, path: Path, embedded_dir: Path) -> transformers.PreTrainedModel:
    """A random checkpoint of family `name` saved at `path` with the embedded tokenizer; biases
    and correction biases drawn too, so that they matter."""
    return save_config(FAMILIES[name](), path, embedded_dir)


def save_config(
    config: transformers.PretrainedConfig,
    path: Path,
    embedded_dir: Path,
    seed: int = 0,
    unit_embeddings: bool = False,
) -> transformers.PreTrainedModel:
    """save_tiny's checkpoint for a config (unit_embeddings: every embedding row of RMS 1)."""
    name = config.model_type
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if unit_embeddings:
            embed = model.get_input_embeddings().weight
            embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias"):
                p.normal_(0, 0.5)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
            if buffer_name.endswith("tid2eid"):  # each token's hashed experts, all distinct
                b.copy_(
                    torch.rand(b.shape[0], model.config.n_routed_experts).argsort(1)[
                        :, : b.shape[1]
                    ]
                )
        for param_name, p in model.named_parameters():  # sinks, slot biases, HC mixes drawn too
            if param_name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0, 0.5)
            if name == "gemma3_text" and "norm" in param_name:  # (1 + weight): zeros hide them
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / file, path / file)
    return model.eval()


def save_tiny_mtp(path: Path, embedded_dir: Path, copy: bool) -> None:
    """The tiny DeepSeek-V3 with one MTP layer (bench.mtp.save_with_mtp): its 3 layers and a
    random MTP layer, or (copy) one MoE layer and an MTP layer repeating it."""
    from bench.mtp import save_with_mtp

    config = FAMILIES["deepseek_v3"]()
    if copy:
        config.num_hidden_layers, config.first_k_dense_replace = 1, 0
    save_with_mtp(config, path, embedded_dir, copy)


def save_tiny_v4_mtp(path: Path, embedded_dir: Path, copy: bool) -> None:
    """A DeepSeek-V4 checkpoint with one MTP layer as DeepSeek ships it (bench.mtp.write_v4_mtp:
    `mtp.0.*` in a file of its own; its attention sliding, its experts top-k). Not copy: the
    4-layer V4 above and a random MTP block. Copy: a one-layer target (sliding, top-k) whose
    MTP layer repeats its layer, e_proj = I and h_proj = 0 over embedding rows of RMS 1, the
    target's head collapse and norm: it drafts what the target computes one position on (its
    context lacks the first token: acceptance high, not total)."""
    from safetensors.torch import load_file

    from bench.mtp import SLIDING_MOE, write_v4_mtp
    from services.model.loading.hf_dir import safetensors_files

    one = transformers.DeepseekV4Config(**(V4 | SLIDING_MOE | {"num_hidden_layers": 1}))
    save_config(
        one if copy else FAMILIES["deepseek_v4"](), path, embedded_dir, unit_embeddings=copy
    )
    source = path if copy else path / "mtp-source"
    if not copy:
        save_config(one, source, embedded_dir, seed=1)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(source):
        state |= load_file(str(file))
    if not copy:
        shutil.rmtree(source)
    write_v4_mtp(path, state, copy)
