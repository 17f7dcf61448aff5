"""FP8 weights kept FP8 on the Triton path (kernels/gpu/fp8.py): the kernel against the
dequantized weight, and a whole FP8 checkpoint loaded with `--kernels triton`, on
PDSERVE_TEST_DEVICE: interpreted on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from services.model.batch import ForwardBatch, SeqChunk
from services.model.kernels import gpu  # first: the interpreter is chosen before triton is imported
from services.model.kernels.gpu import fp8
from services.model.loader import load_model
from tests.services.model.test_fp8 import checkpoints, logits, quantize  # noqa: F401 (fixture)
from tests.support.devices import test_device
from tests.support.tiny_models import VOCAB

DEVICE = test_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU: run these with PDSERVE_TEST_DEVICE=cuda",
)


# relative to the largest output; bfloat16: its output's rounding (2^-9) with room
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize(("out", "inp", "block"), [(70, 48, (16, 16)), (200, 300, (128, 128))])
def test_the_fp8_kernel_computes_with_the_dequantized_weight(dtype, tol, out, inp, block):
    g = torch.Generator().manual_seed(out)
    q, scale = quantize(torch.randn(out, inp, generator=g), block)
    linear = fp8.Fp8BlockLinear(
        q.to(DEVICE), fp8.row_scales(scale, out, block[0]).to(DEVICE), block[1]
    )
    x = torch.randn(33, inp, generator=g).to(dtype=dtype, device=DEVICE)
    got = linear(x)
    reference = x.float() @ linear.dequantized().t()
    assert got.dtype == dtype and got.shape == (33, out)
    assert (got.float() - reference).abs().max() <= tol * reference.abs().max()
    # a row's bits do not depend on the rows beside it
    assert torch.equal(linear(x[5:6])[0], got[5]) and torch.equal(linear(x[:17]), got[:17])


def test_an_fp8_checkpoint_keeps_its_weights_fp8_and_computes_as_dequantized(checkpoints):  # noqa: F811
    path, dequantized, _ = checkpoints
    model = load_model(str(path), dtype="float32", device=str(DEVICE), kernels="triton").model
    layer = model.layers[1]  # an MoE layer: attention's and every expert's products
    kept = [layer.attention.qkv_a, layer.attention.q_b, layer.attention.o,
            *(p for e in layer.mlp.experts for p in (e.gate_up, e.down))]  # fmt: skip
    assert all(isinstance(p, fp8.Fp8BlockLinear) for p in kept)
    assert all(p.weight.dtype == torch.float8_e4m3fn for p in kept)
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = model.new_kv_cache(4, 16)
    batch = ForwardBatch.build([SeqChunk(prompt, 0, [0, 1, 2, 3])], 16, DEVICE)
    got = model.forward(batch, kv)[0].cpu()
    reference = logits(dequantized, prompt)
    assert (got - reference).abs().max() <= 1e-4 * reference.abs().max()
