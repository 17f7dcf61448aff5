"""DeepSeek-VL's image encoder: the SigLIP tower's every patch, through the aligner to the text
width. The rows take the placeholders' place as they are.

    pixels [3, 384, 384] -> tower [576, 1024] -> Linear, GELU (erf), Linear -> [576, hidden]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from services.model.vision.shape import VisionShape
from services.model.vision.siglip import SiglipTower


class DeepseekVLEncoder:
    def __init__(
        self,
        vision: VisionShape,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        def w(name: str) -> torch.Tensor:
            return weights[name].to(device, dtype)

        self.tower = SiglipTower(vision.tower, lambda name: w("vision_model." + name))
        self.linear1 = w("aligner.linear1.weight"), w("aligner.linear1.bias")
        self.linear2 = w("aligner.linear2.weight"), w("aligner.linear2.bias")

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, S, S] -> [tokens, C]
        patches = self.tower(pixels)  # [P, Cv]
        return F.linear(F.gelu(F.linear(patches, *self.linear1)), *self.linear2)
