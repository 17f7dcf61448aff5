"""DeepSeek-V3's multi-token prediction (MTP) layer: the draft a checkpoint carries.

A V3 checkpoint with `num_nextn_predict_layers` = 1 stores one more decoder layer after the
last, `model.layers.{N}.` (N = num_hidden_layers), with three extra parts:

    x  = eh_proj([enorm(embed(t[j + 1])), hnorm(h[j])])     eh_proj: [hidden, 2 hidden]
    h' = shared_head.norm(layer N(x))                       its own attention over its own cache
    logits = shared_head.head(h')                           -> a guess at t[j + 2]

h[j] is the target's final normed hidden state at position j (what its head reads: the state
SGLang and vLLM hand their MTP too). Chained for more tokens, h' takes h's place and the draft
token t's. The layer is served as a one-layer DeepseekModel (its attention latent, its MLP
experts, its cache a pool of its own): `Mtp.forward` gives it the mixed rows as its inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.families.deepseek.config import latent_cache, mla_of
from services.model.families.deepseek.model import DeepseekModel
from services.model.kv_cache import KVCache
from services.model.layers.layer_ops import rms_norm
from services.model.layers.linear import Linear, make_linear
from services.model.loading import hf_dir
from services.settings import DEFAULTS


class Mtp:
    def __init__(
        self,
        block: DeepseekModel,  # one layer: the MTP layer, shared_head's norm and head
        enorm: torch.Tensor,
        hnorm: torch.Tensor,
        eh_proj: Linear,
    ) -> None:
        self.block, self.enorm, self.hnorm, self.eh_proj = block, enorm, hnorm, eh_proj
        self.config = block.config
        self.device = block.device
        self.eps = block.config.rms_norm_eps

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return self.block.new_kv_cache(num_blocks, block_size)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits at batch.logits_rows [rows, vocab] (float32) and every row's h' [T, hidden]:
        row i mixes token batch.token_ids[i] with previous[i], the hidden state before it."""
        block = self.block
        e = rms_norm(block.embed.index_select(0, batch.token_ids), self.enorm, self.eps)
        p = rms_norm(previous.to(block.dtype), self.hnorm, self.eps)
        logits = block.forward(batch, kv, embeds=self.eh_proj(torch.cat([e, p], dim=-1)))
        assert block.hidden is not None
        return logits, block.hidden


def load_mtp(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: str,
    deterministic: bool = DEFAULTS.model.deterministic,
) -> Mtp:
    """The checkpoint's first MTP layer (hf_dir.check_mtp: it has one), its products as the
    model's (`kernels`, `deterministic`)."""
    from safetensors import safe_open

    n = config.num_layers
    own, main = f"model.layers.{n}.", ("model.embed_tokens.weight", "lm_head.weight")
    found: dict[str, torch.Tensor] = {}
    for file in hf_dir.safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith(own) or name in main:
                    found[name] = f.get_tensor(name)
    embed = found.get(own + "embed_tokens.weight", found.get("model.embed_tokens.weight"))
    tied = embed if config.tie_word_embeddings else None
    head = found.get(own + "shared_head.head.weight", found.get("lm_head.weight", tied))
    if embed is None or head is None:
        raise ModelLoadError(path, "the MTP layer needs the embeddings and a head")
    renamed = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": found[own + "shared_head.norm.weight"],
        "lm_head.weight": head,
    }
    skip = ("embed_tokens.", "shared_head.", "enorm.", "hnorm.", "eh_proj.")
    for name, t in found.items():
        rest = name.removeprefix(own)
        if name.startswith(own) and not rest.startswith(skip):
            renamed["model.layers.0." + rest] = t
    moe = config.moe  # the MTP layer has experts where the layers before it do (V3: all
    # after the first dense ones)
    experts = moe is not None and bool(moe.layers) and n >= min(moe.layers)
    layers = dataclasses.replace(moe, layers=(0,)) if experts and moe is not None else None
    one = dataclasses.replace(
        config,
        num_layers=1,
        moe=layers,
        tie_word_embeddings=False,
        cache=latent_cache(1, mla_of(config)),
    )
    block = DeepseekModel(one, renamed, dtype, device, kernels=kernels, deterministic=deterministic)
    block.keep_hidden = True  # h' chains the drafts
    renamed.clear()  # what the block keeps, it holds (its experts are never rebuilt)
    eh = found[own + "eh_proj.weight"].to(device, dtype)
    return Mtp(
        block,
        found[own + "enorm.weight"].to(device, dtype),
        found[own + "hnorm.weight"].to(device, dtype),
        make_linear(eh, None, block.packed, None, block.deterministic),
    )


def mtp_marker(config: ModelConfig) -> str:
    """A tensor only a checkpoint with the MTP layer has."""
    return f"model.layers.{config.num_layers}.eh_proj.weight"
