"""The model runtime.

oneDNN, which computes the products (linear.py), runs bfloat16 on AMX tiles where a CPU has
them, and there picks kernels whose sums differ with the number of rows (on a Xeon with AMX, a
576 x 576 product's row took other bits at 37-257 rows than at 1-36 or 511 and more): a
request's logits would then depend on the batch it shares. So oneDNN is held to AVX-512's
bfloat16 instructions, whose kernels sum a row the same way at every row count
(tests/services/model/test_linear.py checks it on the CPU the suite runs on). The variable is
read once, when oneDNN first runs, so it is set here, before any product; a user's own setting
wins. The attention kernels use AMX themselves (kernels/paged_attention.c), row by row.
"""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
