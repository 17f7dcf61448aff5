"""The Triton latent attention (families/deepseek/triton_mla.py) against the torch reference: a
batch of a prefill chunk over cached blocks, a whole prompt and decode rows, both cache layouts. On
this CPU the kernel runs in Triton's interpreter (small sizes: it is slow there)."""

from __future__ import annotations

import pytest
import torch

from services.model.families.deepseek.mla import MlaAttention
from services.model.kernels import gpu
from services.model.kv_cache import KVCache
from services.model.layers.layer_ops import TorchLayerOps
from services.model.layers.rope import Rotary
from tests.services.model.test_mla import CONFIG, layer_weights, run, seq_chunk
from tests.support.devices import test_device

DEVICE = test_device()

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU: run these with PDSERVE_TEST_DEVICE=cuda",
)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_triton_mla_equals_the_torch_reference(dtype, tol):
    from services.model.families.deepseek.triton_mla import TritonMlaAttention

    ops = TorchLayerOps(CONFIG, Rotary(CONFIG, dtype, DEVICE))
    layer = layer_weights(dtype, device=str(DEVICE))
    g = torch.Generator().manual_seed(1)
    x_by_seq = [
        torch.randn(40, CONFIG.hidden_size, generator=g).to(dtype=dtype, device=DEVICE)
        for _ in range(3)
    ]
    outputs = []
    for attention in (TritonMlaAttention(CONFIG, ops), MlaAttention(CONFIG, ops)):
        kv = KVCache(CONFIG, 12, 16, dtype, DEVICE)
        tables = [[3, 7, 1], [2, 4], [5, 8, 10]]
        run(
            attention,
            layer,
            dtype,
            [seq_chunk(0, 0, 19, tables[0]), seq_chunk(2, 0, 33, tables[2])],
            x_by_seq,
            kv,
        )
        chunks = [seq_chunk(0, 19, 12, tables[0]), seq_chunk(1, 0, 20, tables[1]),
                  seq_chunk(2, 33, 1, tables[2])]  # fmt: skip
        outputs.append(run(attention, layer, dtype, chunks, x_by_seq, kv).float())
    triton_out, reference = outputs
    assert (triton_out - reference).abs().max() <= tol * reference.abs().max()
