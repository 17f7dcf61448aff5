"""DeepSeek-V3's multi-token prediction (MTP) layer: the draft a checkpoint carries.

A V3 checkpoint with `num_nextn_predict_layers` = 1 stores one more decoder layer after the
last, `model.layers.{N}.` (N = num_hidden_layers), with three extra parts:

    x  = eh_proj([enorm(embed(t[j + 1])), hnorm(h[j])])     eh_proj: [hidden, 2 hidden]
    h' = shared_head.norm(layer N(x))                       its own attention over its own cache
    logits = shared_head.head(h')                           -> a guess at t[j + 2]

h[j] is the target's final normed hidden state at position j (what its head reads: the state
SGLang and vLLM hand their MTP too). Chained for more tokens, h' takes h's place and the draft
token t's. The layer is served as a one-layer DecoderModel (its attention latent, its MLP
experts, its cache a pool of its own): `Mtp.forward` gives it the mixed rows as its inputs.

DeepSeek-V4's (`V4Mtp`), stored as `mtp.0.*` beside the model's own tensors, is a V4 block
(hyper-connected streams, its attention a sliding window unless the config says otherwise)
over streams rather than one row:

    x  = e_proj(enorm(embed(t[j + 1])))[None] + h_proj(hnorm(H[j]))   per stream, [N, hidden]
    H' = the block's output streams;  logits = head(norm(collapse(H')))  its own hc_head, norm

H[j] is the target's last streams at position j (before the head collapses them); the
embeddings and head are the target's. Chained, H' takes H's place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from services.model import hf_dir
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.decoder import DecoderModel
from services.model.deepseek_v4 import DeepseekV4Model
from services.model.errors import ModelLoadError, read_json_object
from services.model.kv_cache import KVCache
from services.model.layer_ops import rms_norm
from services.model.linear import Linear, make_linear
from services.model.v4_attention import _rms_norm
from services.model.v4_config import canonical_name, mtp_layer_type
from services.model.weights import check_complete, check_shapes
from services.settings import DEFAULTS


class Mtp:
    def __init__(
        self,
        block: DecoderModel,  # one layer: the MTP layer, shared_head's norm and head
        enorm: torch.Tensor,
        hnorm: torch.Tensor,
        eh_proj: Linear,
    ) -> None:
        self.block, self.enorm, self.hnorm, self.eh_proj = block, enorm, hnorm, eh_proj
        self.config = block.config
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


class V4Mtp(Mtp):
    def __init__(
        self, block: DeepseekV4Model, enorm: torch.Tensor, hnorm: torch.Tensor,
        e_proj: Linear, h_proj: Linear,
    ) -> None:  # fmt: skip
        super().__init__(block, enorm, hnorm, e_proj)  # type: ignore[arg-type]
        self.v4_block, self.e_proj, self.h_proj = block, e_proj, h_proj

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Mtp.forward; previous [T, N hidden] the streams before each row, h' alike."""
        block, rows = self.v4_block, previous.shape[0]
        e = _rms_norm(block.embed.index_select(0, batch.token_ids), self.enorm, self.eps)
        p = _rms_norm(previous.to(block.dtype).view(rows * block.v4.hc_mult, -1), self.hnorm,
                      self.eps)  # fmt: skip
        streams = self.h_proj(p).view(rows, block.v4.hc_mult, -1) + self.e_proj(e)[:, None, :]
        logits = block.forward(batch, kv, streams=streams)
        assert block.hidden is not None
        return logits, block.hidden


def load_mtp(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: str,
    deterministic: bool = DEFAULTS.model.deterministic,
) -> Mtp:  # fmt: skip
    """The checkpoint's first MTP layer, its products as the model's (`kernels`,
    `deterministic`); ModelLoadError where it has none."""
    from safetensors import safe_open

    hf_dir.check_mtp(path, config)
    if config.v4 is not None:
        return _load_v4(path, config, dtype, device, kernels, deterministic)
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
    one = dataclasses.replace(config, num_layers=1, moe=layers, tie_word_embeddings=False)
    block = DecoderModel(one, renamed, dtype, device, kernels=kernels, deterministic=deterministic)
    block.keep_hidden = True  # h' chains the drafts
    renamed.clear()  # what the block keeps, it holds (its experts are never rebuilt)
    eh = found[own + "eh_proj.weight"].to(device, dtype)
    return Mtp(
        block,
        found[own + "enorm.weight"].to(device, dtype),
        found[own + "hnorm.weight"].to(device, dtype),
        make_linear(eh, None, block.packed, None, block.deterministic),
    )


V4_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.")  # the MTP layer's besides its block


def _load_v4(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: str,
    deterministic: bool,
) -> V4Mtp:  # fmt: skip
    from safetensors import safe_open

    assert config.v4 is not None and config.moe is not None
    own, main = "mtp.0.", ("embed.weight", "head.weight")
    found: dict[str, torch.Tensor] = {}
    for file in hf_dir.safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118
                name = canonical_name(stored)
                if name.startswith(own) or name in main:
                    found[name] = f.get_tensor(stored)
    head = found.get("embed.weight" if config.tie_word_embeddings else "head.weight")
    if "embed.weight" not in found or head is None:
        raise ModelLoadError(path, "the MTP layer needs the embeddings and a head")
    weights = {"embed.weight": found["embed.weight"], "head.weight": head}
    for name, t in found.items():
        rest = name.removeprefix(own)
        if not name.startswith(own):
            continue
        if rest.startswith(("norm.", "hc_head_", *V4_OWN)):  # the head's parts, the mix's
            weights[rest] = t
        else:
            weights["layers.0." + rest] = t
    raw = read_json_object(path / "config.json")
    try:
        kind = mtp_layer_type(raw, config.num_layers)
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from None
    hashed = "layers.0.ffn.gate.tid2eid" in weights
    v4 = dataclasses.replace(config.v4, layer_types=(kind,), hash_layers=(0,) if hashed else ())
    one = dataclasses.replace(config, num_layers=1, v4=v4, tie_word_embeddings=False,
                              moe=dataclasses.replace(config.moe, layers=(0,)))  # fmt: skip
    _check_v4(path, one, weights)
    block = DeepseekV4Model(one, weights, dtype, device, kernels=kernels,
                            deterministic=deterministic)  # fmt: skip
    block.keep_hidden = True  # H' chains the drafts
    mtp = V4Mtp(
        block, block._w("enorm.weight", True), block._w("hnorm.weight", True),
        block._linear("e_proj.weight"), block._linear("h_proj.weight"),
    )  # fmt: skip
    weights.clear()  # what the block keeps, it holds
    return mtp


def _check_v4(path: Path, one: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """The MTP layer's tensors, present and of the shapes the config implies (their names as
    the one-layer model reads them: `layers.0.*` for `mtp.0.*`)."""
    h = one.hidden_size
    own = {"e_proj.weight": (h, h), "h_proj.weight": (h, h), "enorm.weight": (h,),
           "hnorm.weight": (h,)}  # fmt: skip
    try:
        check_shapes(path, one, {n: t.shape for n, t in weights.items()})
        check_complete(path, one, weights)
        for name, shape in own.items():
            got = tuple(weights[name].shape) if name in weights else None
            if got != shape:
                raise ModelLoadError(path, f"tensor {name!r} has shape {got}, expected {shape}")
    except ModelLoadError as e:
        raise ModelLoadError(path, f"the MTP layer (mtp.0.*): {e.problem}") from None
