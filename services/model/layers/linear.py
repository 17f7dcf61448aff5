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

On CPUs whose AMX tiles work, bfloat16 products run on them instead (`AmxLinear`,
kernels/amx_linear.c): each row summed one way at every row count, as above, near oneDNN's
own AMX speed (on a 2-core Xeon, 0.6-1.5x oneDNN's AMX kernels by shape, and 7-9x the AVX-512
kernels oneDNN may use there from 32 rows up: see ONEDNN_MAX_CPU_ISA below; `bench.linear`).

The output head in bfloat16 keeps its float32 sums (`Bf16Linear`, kernels/bf16_linear.c, on
AVX512-BF16, which every CPU with AMX has too): logits rounded to bfloat16 are 0.125 apart near
25, and near ties between first tokens went the wrong way (docs/design.md section 7).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Protocol

import torch

from services.model import kernels

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


class AmxLinear:
    """bfloat16 products on AMX tiles (kernels/amx_linear.c), the weight packed once into the
    tiles' operand layout; CPU only, [out, in] multiples of 16 and 32."""

    def __init__(
        self, library: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        assert amx_fits(weight), "AmxLinear takes bfloat16 [16n, 32k] weights on the CPU"
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        plain = weight.contiguous()
        self.packed = torch.empty_like(plain)
        library.amx_linear_pack(
            plain.data_ptr(), self.packed.data_ptr(), self.out_features, self.in_features
        )
        self.bias = None if bias is None else bias.float().contiguous()
        self._product = library.amx_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        if x.shape[0]:
            bias = None if self.bias is None else self.bias.data_ptr()
            self._product(
                x.data_ptr(),
                self.packed.data_ptr(),
                bias,
                y.data_ptr(),
                x.shape[0],
                self.out_features,
                self.in_features,
            )
        return y


def amx_fits(weight: torch.Tensor) -> bool:
    out_f, in_f = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and out_f % 16 == 0
        and in_f % 32 == 0
    )


@functools.cache
def amx_linear_library() -> ctypes.CDLL | None:
    """kernels/amx_linear.c where its tiles run here (and PDSERVE_AMX is not 0), else None."""
    library = kernels.load("amx_linear")
    if library is None or not kernels.amx_usable(library._name, "amx_linear"):
        return None
    if not library.amx_linear_permit():  # the kernel lets this process use the tile state
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.amx_linear_pack.restype = library.amx_linear.restype = None
    library.amx_linear_pack.argtypes = [pointer, pointer, size, size]
    library.amx_linear.argtypes = [pointer] * 4 + [size] * 3
    return library


class Bf16Linear:
    """bfloat16 products whose float32 sums are kept (kernels/bf16_linear.c, AVX512-BF16):
    float32 results by default, the logits' precision; CPU only."""

    def __init__(
        self,
        library: ctypes.CDLL,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        assert weight.dtype == torch.bfloat16 and self.in_features % 2 == 0
        panels = -(-self.out_features // 16)
        self.packed = torch.empty(panels * 16 * self.in_features, dtype=torch.bfloat16)
        library.bf16_linear_pack(
            weight.contiguous().data_ptr(), self.packed.data_ptr(), *weight.shape
        )
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_dtype = out_dtype
        self._product = library.bf16_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # rows of any leading shape
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        x = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=self.out_dtype)
        if x.shape[0]:
            self._product(
                x.data_ptr(),
                self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                y.data_ptr(),
                x.shape[0],
                self.out_features,
                self.in_features,
                int(self.out_dtype == torch.bfloat16),
            )
        return y


@functools.cache
def bf16_linear_library() -> ctypes.CDLL | None:
    """kernels/bf16_linear.c where it was built with AVX512-BF16 (the CPU has it), else None."""
    library = kernels.load("bf16_linear")
    if library is None or not library.bf16_linear_compiled():
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.bf16_linear_pack.restype = None
    library.bf16_linear_pack.argtypes = [pointer, pointer, size, size]
    library.bf16_linear.argtypes = [pointer] * 4 + [size] * 3 + [ctypes.c_int]
    library.bf16_experts.argtypes = [pointer] * 4 + [size] + [pointer] * 4 + [size] * 2
    library.bf16_swiglu.argtypes = [pointer] * 3 + [size] * 3
    return library


def make_logits_linear(
    weight: torch.Tensor, packed: bool, amx: ctypes.CDLL | None, row_invariant: bool
) -> Linear:
    """The output head: float32 logits. A bfloat16 weight on a CPU with AVX512-BF16 keeps its
    float32 sums (Bf16Linear), as does the GPU's row-invariant product; elsewhere make_linear's
    product in the weight's dtype."""
    if row_invariant and weight.device.type == "cuda":
        from services.model.kernels.gpu.row_gemm import RowInvariantLinear

        return RowInvariantLinear(weight, out_dtype=torch.float32)
    library = bf16_linear_library() if packed and weight.dtype == torch.bfloat16 else None
    if library is not None and weight.device.type == "cpu" and weight.shape[1] % 2 == 0:
        return Bf16Linear(library, weight)
    return make_linear(weight, None, packed, amx, row_invariant)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: bool = False,
    amx: ctypes.CDLL | None = None,
    row_invariant: bool = False,
) -> Linear:
    """weight: [out, in] in the compute dtype and device. `packed`: a prepacked product
    (`amx`, the AMX library, where the weight fits it; a bfloat16 weight on a CPU with
    AVX512-BF16 and no AMX tiles in use, kernels/bf16_linear.c's; else oneDNN's); else a plain
    matmul, or on a GPU with `row_invariant` (--deterministic) the Triton one of
    gpu/row_gemm.py. Which one a weight gets depends on the weight and the machine alone, never
    on the rows it will meet."""
    if row_invariant and weight.device.type == "cuda":
        from services.model.kernels.gpu.row_gemm import RowInvariantLinear

        return RowInvariantLinear(weight, bias)
    if packed and amx is not None and amx_fits(weight):
        return AmxLinear(amx, weight, bias)
    if packed and amx is None and bf16_products(weight):
        library = bf16_linear_library()
        assert library is not None
        return Bf16Linear(library, weight, bias, out_dtype=torch.bfloat16)
    return PackedLinear(weight, bias) if packed else DenseLinear(weight, bias)


def bf16_products(weight: torch.Tensor) -> bool:
    """Whether kernels/bf16_linear.c takes this weight: bfloat16 on a CPU that has
    AVX512-BF16, an even number of inputs. There it is oneDNN's equal from 32 rows up and
    faster below (1.1-1.7x at 1 row, 1.1-1.2x at 8: docs/benchmarks.md), with no first-call
    cost for a new row count."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % 2 == 0
        and bf16_linear_library() is not None
    )
