"""Element-wise functions whose result for an element depends on its value alone (float32,
on CPUs: kernels/pointwise.c), and the sigmoid, softmax, softplus, SiLU and GELU of the
window-and-sink models (DeepSeek-V4, gpt-oss, Gemma 3) built on them with IEEE arithmetic,
their sums over a small dimension taken in order. torch's own give an element other bits
depending on where it falls in the tensor (a vector routine over most of it, libm over the
tail), so a row's results changed with the rows beside it.

Without the library (no C compiler, a GPU tensor) torch's functions stand in: results then
repeat, but a row's bits can move with the batch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from services.model import kernels

Map = Callable[[torch.Tensor], torch.Tensor]


def _binding(name: str, fallback: Map) -> Map:
    library = kernels.load("pointwise")
    if library is None:
        return fallback
    fn = getattr(library, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return fallback(x)
        x = x.float().contiguous()
        out = torch.empty_like(x)
        fn(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    return apply


exp = _binding("map_exp", torch.exp)
log1p = _binding("map_log1p", torch.log1p)
cos = _binding("map_cos", torch.cos)
sin = _binding("map_sin", torch.sin)
tanh = _binding("map_tanh", torch.tanh)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), float32."""
    return 1.0 / (1.0 + exp(-x.float()))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + e^-x) in float32 (torch's formula), in x's dtype."""
    xf = x.float()
    return (xf / (1.0 + exp(-xf))).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Gemma's gelu_pytorch_tanh), in float32, in x's dtype."""
    xf = x.float()
    inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
    return (0.5 * xf * (1.0 + tanh(inner))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), float32; x itself above 20 (torch's threshold)."""
    xf = x.float()
    return torch.where(xf > 20.0, xf, log1p(exp(xf.clamp(max=20.0))))


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` (small), its terms added first to last."""
    parts = x.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over a small `dim`, float32."""
    xf = x.float()
    e = exp(xf - xf.amax(dim=dim, keepdim=True))
    return e / ordered_sum(e, dim).unsqueeze(dim)
