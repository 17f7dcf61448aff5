"""Compile every Triton kernel for a GPU that is not here (sm_90, Hopper), in both dtypes:
what a CPU test suite can check of the compiled path (the interpreter checks the results).
A kernel that the interpreter runs but the compiler refuses (a construct only the
interpreter takes, a dtype mix-up in tl.dot) fails here instead of on a user's GPU.

    TRITON_INTERPRET=0 python -m tests.support.triton_compile

Prints one line per kernel; exits 1 at the first that does not compile.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are defined: jit, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launch options say per kernel

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from services.model.families.deepseek import triton_mla as mla
from services.model.kernels.gpu import attention, fp8, kv_write, layer_ops, row_gemm

TARGET = GPUTarget("cuda", 90, 32)
I64, I32 = "i64", "i32"
STRIDES = dict.fromkeys(["kb", "kh", "kdp", "kdl", "kt", "vb", "vh", "vtp", "vtl", "vd"], I64)


def kernels(ty: str) -> list[tuple[object, dict[str, str], dict[str, object]]]:
    p = "*" + ty
    cache = {"k_cache": p, "v_cache": p, **STRIDES}
    return [
        (kv_write._write_kv, {"k": p, "v": p, "k_row": I64, "k_head": I64, "v_row": I64,
         "v_head": I64, "slots": "*i64", **cache, "D": I32, "BS": I32}, {"BLOCK_D": 64}),
        *((attention._decode_split, {"q": p, **cache, "rows": "*i64", "tables": "*i64",
           "table_row": I64, "lens": "*i64", "partial": "*fp32" if split else p,
           "lse": "*fp32" if split else p, "out": p, "scale": "fp32", "H": I32, "D": I32,
           "S": I32}, {"G": 3, "BLOCK_G": 4, "BS": 16, "BLOCK_D": 64,
           "SPLIT": attention.SPLIT_BLOCKS, "DIRECT": not split}) for split in (True, False)),
        (attention._combine, {"partial": "*fp32", "lse": "*fp32", "rows": "*i64", "out": p,
         "H": I32, "D": I32, "S": I32}, {"BLOCK_S": 4, "BLOCK_D": 64}),
        (attention._prefill, {"q": p, **cache, "rows": "*i64", "qlens": "*i64", "lens": "*i64",
         "tables": "*i64", "table_row": I64, "out": p, "scale": "fp32", "H": I32, "D": I32},
         {"G": 3, "BS": 16, "BLOCK_M": attention.BLOCK_M, "BLOCK_D": 64,
          "F32_DOT": ty == "fp32"}),
        (layer_ops._add_rms_norm_kernel, {"h_ptr": p, "delta_ptr": p, "weight_ptr": p,
         "out_ptr": p, "h_row_stride": I32, "h_col_stride": I32, "delta_row_stride": I32,
         "delta_col_stride": I32, "out_row_stride": I32, "rows": I32, "dim": I32,
         "eps": "fp32"}, {"HAS_DELTA": True, "ROWS": 4, "BLOCK": 1024}),
        (layer_ops._rotary_kernel, {"qkv_ptr": p, "cos_ptr": p, "sin_ptr": p,
         "positions_ptr": "*i64", "q_ptr": p, "k_ptr": p, "qkv_row_stride": I32,
         "qkv_col_stride": I32, "table_row_stride": I32, "q_row_stride": I32,
         "k_row_stride": I32, "rows": I32, "num_heads": I32, "num_kv_heads": I32,
         "head_dim": I32}, {"PAIRS": 32, "HALF": 32}),
        (mla._attend, {"q": "*fp32", "k_cache": p, "tables": "*i64", "table_row": I64,
         "row_seq": "*i64", "lens": "*i64", "out": "*fp32", "kb": I64, "kdp": I64, "kdl": I64,
         "kt": I64, "H": I32, "D": I32, "C": I32, "scale": "fp32"}, {"BS": 16, "BLOCK_D": 1024}),
        *((row_gemm._matmul, {"x": p, "w": "*fp8e4nv" if scaled else p, "s": "*fp32",
           "bias": p, "out": p, "T": I32, "N": I32, "K": I32, "x_row": I32, "w_row": I32,
           "s_row": I32, "out_row": I32},
          {"SCALE_K": 128, "HAS_SCALE": scaled, "HAS_BIAS": not scaled,
           "F32_DOT": ty == "fp32", "BLOCK_M": row_gemm.BLOCK_M, "BLOCK_N": row_gemm.BLOCK_N,
           "BLOCK_K": fp8.MAX_BLOCK_K if scaled else row_gemm.BLOCK_K})
          for scaled in (True, False)),
        (layer_ops._silu_mul_kernel, {"gate_up_ptr": p, "out_ptr": p, "gate_up_row_stride": I32,
         "gate_up_col_stride": I32, "out_row_stride": I32, "rows": I32, "ff": I32},
         {"BLOCK": 1024}),
    ]  # fmt: skip


def main() -> int:
    for ty in ("fp32", "bf16"):
        for fn, signature, constants in kernels(ty):
            name = getattr(fn, "__name__", str(fn))
            signature = {**signature, **dict.fromkeys(constants, "constexpr")}
            try:
                compiled = triton.compile(ASTSource(fn, signature, constants), target=TARGET)
            except Exception as e:  # any compiler error: the kernel and why
                print(f"{name} {ty}: does not compile for sm_90: {e}")
                return 1
            print(f"{name} {ty}: {compiled.asm['ptx'].count(chr(10))} lines of PTX")
    return 0


if __name__ == "__main__":
    sys.exit(main())
