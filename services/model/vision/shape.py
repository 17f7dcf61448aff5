"""What the shared code needs of a model that reads images (no torch: the router reads it).

An image enters the prompt as `tokens_per_image` placeholder tokens (`image_token_id`); the
vision encoder's output, one row per placeholder, takes their embeddings' place. The chat
template writes one token where an image goes; the router widens it to the whole run before
tokenizing, as the model's processor does:

    Gemma 3:      <begin>  ->  {around}<begin><image> x tokens_per_image<end>{around}
    DeepSeek-VL:  <image>  ->  <image> x tokens_per_image
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from services.model.vision.images import Preprocess


@dataclass(frozen=True)
class SiglipShape:
    """A SigLIP vision transformer (Gemma 3's tower): patches of `patch_size` of an
    `image_size` square, learned positions, pre-norm layers, GELU (tanh) MLPs, a final norm."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def tensor_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower under `prefix` and its shape."""
        c, m, p = self.hidden_size, self.intermediate_size, self.patch_size
        shapes = {
            f"{prefix}embeddings.patch_embedding.weight": (c, 3, p, p),
            f"{prefix}embeddings.patch_embedding.bias": (c,),
            f"{prefix}embeddings.position_embedding.weight": (self.patches_per_side**2, c),
            f"{prefix}post_layernorm.weight": (c,),
            f"{prefix}post_layernorm.bias": (c,),
        }
        for i in range(self.num_layers):
            layer = f"{prefix}encoder.layers.{i}."
            for norm in ("layer_norm1", "layer_norm2"):
                shapes |= {f"{layer}{norm}.weight": (c,), f"{layer}{norm}.bias": (c,)}
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                a = f"{layer}self_attn.{proj}"
                shapes |= {f"{a}.weight": (c, c), f"{a}.bias": (c,)}
            shapes |= {f"{layer}mlp.fc1.weight": (m, c), f"{layer}mlp.fc1.bias": (m,),
                       f"{layer}mlp.fc2.weight": (c, m), f"{layer}mlp.fc2.bias": (c,)}  # fmt: skip
        return shapes


@dataclass(frozen=True)
class VisionShape:
    image_token_id: int  # each of an image's embeddings is one such token in the prompt
    tokens_per_image: int
    preprocess: Preprocess
    tower: SiglipShape
    # "module:function" building the family's encoder from (VisionShape, weights, dtype,
    # device): a callable pixels [3, H, W] -> embeddings [tokens_per_image, text hidden]
    encoder: str
    # the checkpoint's tensors the encoder reads (names starting so): an encode worker
    # reads these alone
    weights: tuple[str, ...] = ()
    # those tensors, each by its name as `renames` leave it, and its shape
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (pattern, replacement): a stored tensor's name made the name the model reads, each
    # applied once in order, before the text family's own (families.stored_name)
    renames: tuple[tuple[str, str], ...] = ()
    # what the chat template writes where an image goes: a begin token, widened to begin,
    # placeholders, end, with `around` on both sides (Gemma 3); None: the placeholder token
    # itself, widened to the image's run (DeepSeek-VL)
    begin_token_id: int | None = None
    end_token_id: int | None = None
    around: str = ""
    # an image's placeholders attend to one another both ways (Gemma 3), not only to those
    # before them: a prompt's chunk never ends inside an image
    bidirectional: bool = False

    @property
    def place_token_id(self) -> int:
        """The token the chat template writes where an image goes."""
        return self.image_token_id if self.begin_token_id is None else self.begin_token_id

    def expansion(self, text: Callable[[int], str]) -> str:
        """The text an image's place token becomes (`text`: a token id's text)."""
        run = text(self.image_token_id) * self.tokens_per_image
        if self.begin_token_id is None:
            return run
        end = "" if self.end_token_id is None else text(self.end_token_id)
        return f"{self.around}{text(self.begin_token_id)}{run}{end}{self.around}"

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.tensors)

    def stored_name(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name, count=1)
        return name
