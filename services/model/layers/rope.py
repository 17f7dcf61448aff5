"""Rotary position embeddings, rotate-half form (and DeepSeek's adjacent pairs), with linear,
Llama 3 and YaRN frequency scaling.

cos/sin are tabulated once per model for every position; a forward pass indexes the table.
The arithmetic follows transformers' exactly so float32 results agree bit for bit.
"""

from __future__ import annotations

import math

import torch

from services.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    return _llama3(inv_freq, scaling)


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those turning more than beta_fast
    times kept, a linear ramp between."""

    def dimension(rotations: float) -> float:  # the dimension turning `rotations` times
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # share of each frequency left as trained
    frequencies = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (s.factor * frequencies)) * (1 - kept) + (1.0 / frequencies) * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor YaRN applies to cos and sin (1 for every other scaling)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        low = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        return yarn_mscale(scaling.factor, scaling.mscale) / low
    return yarn_mscale(scaling.factor)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, the band between interpolated."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """cos/sin tables [max_positions, dim] and their application to q or k; `dim` is the
    rotary part of a head (default: all of it; MLA's rope_dim)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, dim: int | None = None
    ) -> None:
        dim = dim or config.head_dim
        inv_freq = inverse_frequencies(dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        cos, sin = emb.cos(), emb.sin()
        factor = attention_factor(config.rope_scaling)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, D], broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def turn(x: torch.Tensor, by: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary keys x [..., T, heads, D] (any leading dimensions: layers) turned
    on by `by` [T] positions (any integers): angles add, R(a) R(b) = R(a + b), so keys rotated
    at p come out as if rotated at p + by. Pure angles (no YaRN factor: the keys carry it
    once already), in float32, in x's dtype."""
    angles = by.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1).float()[:, None]  # [T, 1, D]
    return apply_rotary(x.float(), emb.cos(), emb.sin()).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over adjacent pairs (x0, x1), (x2, x3), ... as DeepSeek lays out its rotary
    dimensions; the result de-interleaved, [rotated evens | rotated odds]. q and k both come
    out so, so their dot products are those of the interleaved form."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
