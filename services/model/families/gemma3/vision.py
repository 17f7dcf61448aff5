"""Gemma 3's image encoder: the SigLIP tower, its patches average-pooled to
`mm_tokens_per_image` rows, RMS-normed ((1 + weight), float32) and projected to the text
width. The rows take the placeholders' place as they are: not scaled as token embeddings are.

    pixels [3, 896, 896] -> tower [4096, 1152] -> pool 4x4 -> [256, 1152] -> norm, project
    -> [256, text hidden]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from services.model.vision.shape import SiglipShape, VisionShape
from services.model.vision.siglip import SiglipTower


class Gemma3Encoder:
    def __init__(
        self,
        vision: VisionShape,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert isinstance(vision.tower, SiglipShape)
        self.shape = vision.tower
        self.side = round(vision.tokens_per_image**0.5)  # pooled rows per side

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device, dtype)

        self.tower = SiglipTower(vision.tower, lambda name: w("vision_tower." + name))
        self.norm = w("multi_modal_projector.mm_soft_emb_norm.weight")
        self.project = w("multi_modal_projector.mm_input_projection_weight")  # [Cv, C]

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, S, S] -> [tokens, C]
        patches = self.tower(pixels)  # [P, Cv]
        side = self.shape.patches_per_side
        grid = patches.transpose(0, 1).reshape(1, -1, side, side)
        kernel = side // self.side
        pooled = F.avg_pool2d(grid, kernel, kernel).flatten(2)[0].transpose(0, 1)
        xf = pooled.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.layer_norm_eps)
        normed = (normed * (1.0 + self.norm.float())).to(pooled.dtype)
        return normed @ self.project
