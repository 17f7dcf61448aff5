"""`--quantization int8`: the decoder layers' products in int8, for CPUs with VNNI (or AMX).

What is quantized. The q/k/v, o and gate/up projections (76% of a layer's weights; a model
names them in `int8_products`, Llama's and Gemma 3's alike): weights to
int8 with one scale per output row, activations to int8 with one scale per row computed at each
call, products summed in int32 by oneDNN's VNNI kernels (`torch._int_mm`), then scaled back.
Measured on the embedded model (bench/quantization.py, docs/benchmarks.md): these three alone
raise perplexity by 0.3% in bfloat16 and 0.5% in float32; with down_proj too, by 1.0%,
because its input (SiLU(gate) * up; Gemma's GELU(gate) * up) carries the outlier channels
int8 rows cannot hold; down_proj and the LM head stay in the compute dtype.

Outliers. Per input channel j, activations are divided by s_j and the weights' column j
multiplied by it (SmoothQuant, alpha 0.5): s_j = sqrt(max|x_j| / max|W_j|), with max|x_j| from
one pass of the unquantized model over a fixed calibration text (calibration.txt) when the model
loads. Without it perplexity rose 2.6% instead of 1.0%.

Determinism. Integer sums are exact in any order, and the scaling is element-wise in a fixed
order, so a row's result depends only on that row: the same bits alone or in any batch, whatever
kernel oneDNN picks for the row count. Where the int8 product is not exact (a CPU whose oneDNN
kernel saturates 16-bit intermediates, as AVX2's vpmaddubsw can), the products run in float64
instead, which is exact for these sums (|sum| < 2^25) and gives the same bits, slower.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from kvstore.block_hash import BLOCK_SIZE as BLOCK
from services.model.batch import ForwardBatch, SeqChunk
from services.model.layers.linear import Linear

log = logging.getLogger("pdserve.quantize")

QUANTIZATIONS = ("none", "int8")
ALPHA = 0.5  # SmoothQuant's migration strength: half the outliers' range moves to the weights
TINY = 1e-30  # the scale of an all-zero row (kernels/int8.c has the same)
CALIBRATION = Path(__file__).with_name("calibration.txt")
CALIBRATION_WINDOW = 512  # tokens per calibration pass, each window from an empty cache


def quantize_rows(x: torch.Tensor, smooth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of x * smooth: (q [T, in] int8, scale [T, 1] float32)."""
    xf = x.float() * smooth
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(TINY) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


@functools.cache
def int8_matmul_exact() -> bool:
    """Whether torch._int_mm sums int8 products exactly here (probed at the extremes)."""
    if not hasattr(torch, "_int_mm"):
        return False
    a = torch.full((4, 1536), -127, dtype=torch.int8)
    a[1::2] = 127
    b = torch.full((1536, 32), 127, dtype=torch.int8)
    b[:, ::3] = -127
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:
        return False
    return bool(torch.equal(got.long(), a.long() @ b.long()))


class Int8Kernels:
    """kernels/int8.c: quantize and dequantize in one pass per row each."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._quantize = library.quantize_rows
        self._quantize.argtypes = [p] * 4 + [i64] * 2 + [c_int]
        self._quantize.restype = None
        self._dequantize = library.dequantize
        self._dequantize.argtypes = [p] * 4 + [i64] * 2 + [c_int]
        self._dequantize.restype = None

    def quantize(self, x: torch.Tensor, smooth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x if x.is_contiguous() else x.contiguous()
        rows, dim = x.shape
        q = torch.empty(rows, dim, dtype=torch.int8)
        scale = torch.empty(rows, 1, dtype=torch.float32)
        self._quantize(
            x.data_ptr(),
            smooth.data_ptr(),
            q.data_ptr(),
            scale.data_ptr(),
            rows,
            dim,
            int(x.dtype == torch.bfloat16),
        )
        return q, scale

    def dequantize(
        self, acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        rows, cols = acc.shape
        y = torch.empty(rows, cols, dtype=dtype)
        self._dequantize(
            acc.data_ptr(),
            xs.data_ptr(),
            ws.data_ptr(),
            y.data_ptr(),
            rows,
            cols,
            int(dtype == torch.bfloat16),
        )
        return y


KERNEL_LANES = 16  # the C kernels take rows whose length is a multiple of this


@functools.cache
def int8_kernels() -> Int8Kernels | None:
    from services.model import kernels

    library = kernels.load("int8")
    return None if library is None else Int8Kernels(library)


class Int8Linear:
    """y = x @ W.T with W and each row of x * smooth in int8 (see the module's docstring)."""

    def __init__(
        self,
        weight: torch.Tensor,
        smooth: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        kernels: Int8Kernels | None = None,
    ) -> None:
        """weight: [out, in], any float dtype; smooth: [in] float32, what x is multiplied by
        (W's columns are divided by it)."""
        q, scale = quantize_rows(weight.float() / smooth, torch.ones(weight.shape[1]))
        self.weight_t = q.t()  # [in, out], a view of the row-major [out, in]: oneDNN's fastest
        self.scale = scale.reshape(1, -1).contiguous()  # [1, out]
        self.smooth = smooth.float().contiguous()
        self.bias = bias
        self.dtype = dtype
        self.out_features = int(weight.shape[0])
        fits = weight.shape[0] % KERNEL_LANES == 0 and weight.shape[1] % KERNEL_LANES == 0
        self.kernels = kernels if fits else None
        self.exact_int8 = int8_matmul_exact()
        self.weight_f64 = None if self.exact_int8 else self.weight_t.double()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            q, xs = self.kernels.quantize(x, self.smooth)
            y = self.kernels.dequantize(self._sums(q), xs, self.scale, self.dtype)
        else:
            q, xs = quantize_rows(x, self.smooth)
            y = (self._sums(q).float() * xs * self.scale).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def _sums(self, q: torch.Tensor) -> torch.Tensor:
        """int32 [T, out]: exact sums of q [T, in] int8 times the weights."""
        if self.exact_int8:
            return torch._int_mm(q, self.weight_t)
        assert self.weight_f64 is not None
        return (q.double() @ self.weight_f64).to(torch.int32)


class Observer:
    """A Linear that records each input channel's largest magnitude, then computes as before."""

    def __init__(self, inner: Linear) -> None:
        self.inner = inner
        self.out_features = inner.out_features
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        top = x.float().abs().amax(dim=0)
        self.amax = top if self.amax is None else torch.maximum(self.amax, top)
        return self.inner(x)


# A model that can take int8 weights (Capabilities.int8) names its quantized products in
# `int8_products`: each one's path in a layer (attribute names, outermost first) and the
# checkpoint's matrices stacked in it, named after `model.layers.{i}.`.
Products = dict[tuple[str, ...], tuple[str, ...]]


def product_at(layer: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        layer = getattr(layer, name)
    return layer


def _replaced(layer: Any, products: dict[tuple[str, ...], Any]) -> Any:
    """`layer` with the products at the given paths replaced (its frozen parts copied)."""
    changes: dict[str, Any] = {}
    inner: dict[str, dict[tuple[str, ...], Any]] = {}
    for (head, *rest), product in products.items():
        if rest:
            inner.setdefault(head, {})[tuple(rest)] = product
        else:
            changes[head] = product
    for head, below in inner.items():
        changes[head] = _replaced(getattr(layer, head), below)
    return dataclasses.replace(layer, **changes)


def quantize_int8(model: Any, weights: dict[str, torch.Tensor], calibration: list[int]) -> None:
    """Replaces the model's quantizable products (`model.int8_products`) by Int8Linear, in
    place; `weights` are the checkpoint's tensors the model was built from, `calibration` the
    calibration text's ids."""
    assert model.device.type == "cpu", "int8 products are oneDNN's: CPUs only (load_model checks)"
    products: Products = model.int8_products
    observed = [
        _replaced(layer, {path: Observer(product_at(layer, path)) for path in products})
        for layer in model.layers
    ]
    model.layers = observed
    _calibrate(model, calibration)
    kernels = int8_kernels() if model.dtype in (torch.float32, torch.bfloat16) else None
    if not int8_matmul_exact():
        log.warning("int8 products are not exact in this torch on this CPU: computing in float64")
    quantized = []
    for i, layer in enumerate(observed):
        fields: dict[tuple[str, ...], Any] = {}
        prefix = f"model.layers.{i}."
        for path, names in products.items():
            w = torch.cat([weights[prefix + n + ".weight"].float() for n in names])
            bias = None
            if all(prefix + n + ".bias" in weights for n in names):
                bias = torch.cat([weights[prefix + n + ".bias"] for n in names]).to(model.dtype)
            amax = product_at(layer, path).amax
            fields[path] = Int8Linear(w, smoothing(amax, w), model.dtype, bias, kernels)
        quantized.append(_replaced(layer, fields))
    model.layers = quantized
    model.quantization = "int8"


def smoothing(amax: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """1 / s_j, what x's channel j is multiplied by: s_j = max|x_j|^a / max|W_j|^(1 - a)."""
    if amax is None:
        raise ValueError("calibration never reached this product")
    w_max = weight.abs().amax(dim=0).clamp_min(1e-5)
    s = (amax.clamp_min(1e-5) ** ALPHA / w_max ** (1 - ALPHA)).clamp_min(1e-5)
    return (1.0 / s).float()


def _calibrate(model: Any, ids: list[int]) -> None:
    """Runs the model over `ids` in windows, each from an empty cache; logits unused."""
    n = CALIBRATION_WINDOW
    kv = model.new_kv_cache(n // BLOCK, BLOCK)
    for start in range(0, len(ids), n):
        window = ids[start : start + n]
        table = list(range(-(-len(window) // BLOCK)))
        model.forward(ForwardBatch.build([SeqChunk(window, 0, table)], BLOCK), kv)


def calibration_text() -> str:
    return CALIBRATION.read_text(encoding="utf-8")
