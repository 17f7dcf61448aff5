"""Matrix multiplies by a weight: one interface, the fastest layout the device has.

On CPUs, oneDNN with the weight reordered once into its blocked layout ("prepacked") beats
torch's default matmul by 1.5-3x for the skinny products of decode, in float32 and bfloat16
alike. Elsewhere (GPUs, torch builds without oneDNN) the weight is kept transposed and
contiguous for a plain matmul.

Determinism. Prepacked, each output row gets the same bits whatever the number of rows, so
results do not depend on batch composition or chunking: checked bit for bit for the embedded
model's five products at 1 to 600 rows, float32 and bfloat16, on an AVX512-BF16 Zen 4, where
oneDNN runs `brg_matmul` for every row count (tests/services/model/test_linear.py runs the
check on whatever CPU the suite runs on). oneDNN promises no such thing: it picks kernels by
shape and ISA, and a CPU that gives a lone row or a tail of rows another kernel breaks it, as
the single-row case below did; the test is what says. The dense fallback's BLAS is not
row-invariant: its rows move in the last bits with the batch.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

# oneDNN runs bfloat16 on AMX tiles where a CPU has them, and there picks kernels whose sums
# differ with the number of rows (on a Xeon with AMX, a 576 x 576 product's row took other
# bits at 37-257 rows than at 1-36 or 511 and more): a request's logits would depend on the
# batch it shares. So oneDNN is held to AVX-512's bfloat16 kernels, which sum a row the same
# way at every row count (tests/services/model/test_linear.py checks it on the suite's CPU).
# oneDNN reads the variable once, when it first runs: set here, at import, before any product
# (in the processes that compute; a process that only launches others, e.g. bench.serving
# starting vLLM, never imports this). A user's own setting wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] (plus bias when there is one)."""
        ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight_t = weight.t().contiguous()  # [in, out]
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


# oneDNN computes a lone row on another kernel (other rounding) once the inner dimension
# passes this; lone rows of such products are doubled so every row rounds the same way.
# Measured on the Zen 4: needed in float32; bfloat16's lone rows match without it.
SINGLE_ROW_KERNEL_ABOVE = 1024


class PackedLinear:
    """oneDNN inner product on a weight prepacked for it; CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.bias = bias
        self.out_features = int(weight.shape[0])
        self.pad_single_row = weight.shape[1] > SINGLE_ROW_KERNEL_ABOVE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_single_row and x.shape[0] == 1:
            return self._product(x.expand(2, -1))[:1]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:  # the op set is internal to torch: check it works here before relying on it
        probe = PackedLinear(torch.ones(4, 8, dtype=dtype))
        out = probe(torch.ones(2, 8, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 8.0, dtype=dtype)))


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False
) -> Linear:
    """weight: [out, in] in the compute dtype and device."""
    return PackedLinear(weight, bias) if packed else DenseLinear(weight, bias)
