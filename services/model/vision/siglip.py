"""A SigLIP vision transformer (Gemma 3's tower), one image at a time: an image's embeddings
are computed on tensors of its own shape alone, so their bits depend on the image and nothing
else (no batch, no other request), which is what lets an encoder cache and an encode worker
hand them to any prefill.

    pixels [3, S, S] -> patches [P, C] (P = (S / patch)^2) -> layers -> norm -> [P, C]

Transformers' arithmetic (its SDPA attention) in the weights' dtype: torch's fused attention
and GELU, whose bits are fixed for a shape, and every image of a model has the same shape.
(Materialized logits and a float32 softmax took 0.75 of 2.1 s an image at 1,024 patches.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.vision.shape import SiglipShape

Weight = Callable[[str], torch.Tensor]  # a tensor by its name under the tower's prefix


@dataclass(frozen=True)
class SiglipLayer:
    norm1: tuple[torch.Tensor, torch.Tensor]  # weight, bias
    qkv: tuple[torch.Tensor, torch.Tensor]  # [3C, C], [3C]
    out: tuple[torch.Tensor, torch.Tensor]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


class SiglipTower:
    def __init__(self, shape: SiglipShape, w: Weight) -> None:
        self.shape = shape

        def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w(name + ".weight"), w(name + ".bias")

        def stacked(*names: str) -> tuple[torch.Tensor, torch.Tensor]:
            parts = [pair(n) for n in names]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        self.patch = pair("embeddings.patch_embedding")
        self.positions = w("embeddings.position_embedding.weight")
        self.post_norm = pair("post_layernorm")
        self.layers = []
        for i in range(shape.num_layers):
            p = f"encoder.layers.{i}."
            a = p + "self_attn."
            self.layers.append(
                SiglipLayer(
                    norm1=pair(p + "layer_norm1"),
                    qkv=stacked(a + "q_proj", a + "k_proj", a + "v_proj"),
                    out=pair(a + "out_proj"),
                    norm2=pair(p + "layer_norm2"),
                    fc1=pair(p + "mlp.fc1"),
                    fc2=pair(p + "mlp.fc2"),
                )
            )

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, S, S] -> [P, C]
        s = self.shape
        weight, bias = self.patch
        patches = F.conv2d(pixels[None].to(weight.dtype), weight, bias, stride=s.patch_size)
        h = patches.flatten(2)[0].transpose(0, 1) + self.positions  # [P, C]
        heads, eps = s.num_heads, s.layer_norm_eps
        for layer in self.layers:
            x = F.layer_norm(h, h.shape[-1:], *layer.norm1, eps)
            q, k, v = F.linear(x, *layer.qkv).view(len(x), 3, heads, -1).unbind(1)
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, P, D]: fused on CPUs
            x = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(len(x), -1)
            h = h + F.linear(x, *layer.out)
            x = F.layer_norm(h, h.shape[-1:], *layer.norm2, eps)
            h = h + F.linear(F.gelu(F.linear(x, *layer.fc1), approximate="tanh"), *layer.fc2)
        return F.layer_norm(h, h.shape[-1:], *self.post_norm, eps)
