"""DeepSeek-V4's (`V4Mtp`), stored as `mtp.0.*` beside the model's own tensors, is a V4 block
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

from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError, read_json_object
from services.model.families.deepseek.mtp import Mtp
from services.model.families.deepseek_v4.config import (
    cache_spec,
    mtp_layer_type,
    v4_of,
)
from services.model.families.deepseek_v4.model import DeepseekV4Model
from services.model.families.deepseek_v4.names import canonical_name
from services.model.kv_cache import KVCache
from services.model.layers.layer_ops import rms_norm_f32
from services.model.layers.linear import Linear
from services.model.loading import hf_dir
from services.model.loading.weights import check_complete, check_shapes


class V4Mtp(Mtp):
    def __init__(
        self,
        block: DeepseekV4Model,
        enorm: torch.Tensor,
        hnorm: torch.Tensor,
        e_proj: Linear,
        h_proj: Linear,
    ) -> None:
        super().__init__(block, enorm, hnorm, e_proj)  # type: ignore[arg-type]
        self.v4_block, self.e_proj, self.h_proj = block, e_proj, h_proj

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Mtp.forward; previous [T, N hidden] the streams before each row, h' alike."""
        block, rows = self.v4_block, previous.shape[0]
        e = rms_norm_f32(block.embed.index_select(0, batch.token_ids), self.enorm, self.eps)
        p = rms_norm_f32(
            previous.to(block.dtype).view(rows * block.v4.hc_mult, -1), self.hnorm, self.eps
        )
        streams = self.h_proj(p).view(rows, block.v4.hc_mult, -1) + self.e_proj(e)[:, None, :]
        logits = block.forward(batch, kv, streams=streams)
        assert block.hidden is not None
        return logits, block.hidden


V4_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.")  # the MTP layer's besides its block


def load_mtp(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: str,
    deterministic: bool,
) -> V4Mtp:
    from safetensors import safe_open

    """The checkpoint's MTP layer (hf_dir.check_mtp: it has one), a one-layer V4 block over
    the target's streams, its products as the model's (`kernels`, `deterministic`)."""
    assert config.moe is not None
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
    v4 = dataclasses.replace(v4_of(config), layer_types=(kind,), hash_layers=(0,) if hashed else ())
    one = dataclasses.replace(
        config,
        num_layers=1,
        shape=v4,
        cache=cache_spec(v4, config.head_dim),
        tie_word_embeddings=False,
        moe=dataclasses.replace(config.moe, layers=(0,)),
    )
    _check_v4(path, one, weights)
    block = DeepseekV4Model(
        one, weights, dtype, device, kernels=kernels, deterministic=deterministic
    )
    block.keep_hidden = True  # H' chains the drafts
    mtp = V4Mtp(
        block,
        block._w("enorm.weight", True),
        block._w("hnorm.weight", True),
        block._linear("e_proj.weight"),
        block._linear("h_proj.weight"),
    )
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


def mtp_marker(config: ModelConfig) -> str:
    """A tensor only a checkpoint with the MTP layer has."""
    return "mtp.0.e_proj.weight"
