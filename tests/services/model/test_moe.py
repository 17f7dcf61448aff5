"""Mixture-of-experts layers: grouped experts equal a loop over experts, routers pick as each
family's does, a token's output does not depend on who shares its experts, counts are exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.model.config import ModelConfig, MoeShape
from services.model.layers.layer_ops import default_layer_ops
from services.model.layers.linear import make_linear, packed_linear_available
from services.model.layers.moe import DenseMlp, Moe
from services.model.layers.rope import Rotary

HIDDEN, FF, EXPERTS = 64, 32, 8
ROUTERS = {
    "mixtral": MoeShape(EXPERTS, 2, FF, (0,), norm_topk_prob=True),
    "qwen2_moe": MoeShape(EXPERTS, 3, FF, (0,), shared_intermediate_size=48, shared_gate=True),
    "deepseek_v2": MoeShape(
        EXPERTS,
        3,
        FF,
        (0,),
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        shared_intermediate_size=64,
        float32_router=True,
    ),
    "deepseek_v3": MoeShape(
        EXPERTS,
        2,
        FF,
        (0,),
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        shared_intermediate_size=32,
        float32_router=True,
    ),
}
CONFIG = ModelConfig(
    architecture="mixtral",
    vocab_size=10,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
)


def moe_layer(shape: MoeShape, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A MoE layer of random weights, and the plain tensors it was made of."""
    g = torch.Generator().manual_seed(seed)
    packed = packed_linear_available(torch.device("cpu"), dtype)

    def w(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g) * s[-1] ** -0.5

    def mlp(ff: int) -> tuple[DenseMlp, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        gate, up, down = w(ff, HIDDEN), w(ff, HIDDEN), w(HIDDEN, ff)
        made = DenseMlp(
            make_linear(torch.cat([gate, up]).to(dtype), packed=packed),
            make_linear(down.to(dtype), packed=packed),
        )
        return made, (gate, up, down)

    experts = [mlp(FF) for _ in range(EXPERTS)]
    shared = mlp(shape.shared_intermediate_size) if shape.shared_intermediate_size else None
    router, bias = w(EXPERTS, HIDDEN) * 4, torch.randn(EXPERTS, generator=g) * 0.1
    router_dtype = torch.float32 if shape.float32_router else dtype
    shared_gate = w(1, HIDDEN)
    layer = Moe(
        shape,
        gate=make_linear(router.to(router_dtype), packed=packed),
        router_dtype=router_dtype,
        correction_bias=bias if shape.topk_method == "noaux_tc" else None,
        experts=[e for e, _ in experts],
        shared=shared[0] if shared else None,
        shared_gate=make_linear(shared_gate.to(dtype), packed=packed)
        if shape.shared_gate
        else None,
    )
    plain = {"experts": [p for _, p in experts], "shared": shared and shared[1],
             "router": router, "bias": bias, "shared_gate": shared_gate}  # fmt: skip
    return layer, plain


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def loop_reference(shape: MoeShape, plain, x: torch.Tensor) -> torch.Tensor:
    """Routing written out per token, experts one at a time (float64)."""
    x = x.double()
    logits = x @ plain["router"].double().T
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = logits[t].sigmoid() if shape.scoring == "sigmoid" else logits[t].softmax(-1)
        choice = scores + plain["bias"].double() if shape.topk_method == "noaux_tc" else scores
        if shape.topk_method != "greedy":
            groups = choice.view(shape.n_group, -1)
            if shape.topk_method == "noaux_tc":
                rank = groups.topk(2).values.sum(-1)
            else:
                rank = groups.max(-1).values
            keep = torch.zeros(shape.n_group, dtype=torch.bool)
            keep[rank.topk(shape.topk_group).indices] = True
            fill = float("-inf") if shape.topk_method == "noaux_tc" else 0.0
            choice = groups.masked_fill(~keep[:, None], fill).flatten()
        ids = choice.topk(shape.top_k).indices
        weights = scores[ids]
        if shape.norm_topk_prob:
            weights = weights / weights.sum()
        for e, wt in zip(ids.tolist(), weights * shape.routed_scaling_factor, strict=True):
            gate, up, down = (m.double() for m in plain["experts"][e])
            out[t] += wt * swiglu(x[t], gate, up, down)
        if plain["shared"] is not None:
            shared = swiglu(x[t], *(m.double() for m in plain["shared"]))
            if shape.shared_gate:
                shared = shared * torch.sigmoid(x[t] @ plain["shared_gate"].double().T)
            out[t] += shared
    return out


def layer_ops(dtype: torch.dtype):
    return default_layer_ops(
        CONFIG, Rotary(CONFIG, dtype, torch.device("cpu")), torch.device("cpu"), dtype
    )


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_grouped_experts_equal_routing_written_out_token_by_token(family):
    shape = ROUTERS[family]
    layer, plain = moe_layer(shape)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = layer(x, layer_ops(torch.float32))
    expected = loop_reference(shape, plain, x)
    assert torch.allclose(got.double(), expected, atol=2e-5, rtol=1e-4), family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_tokens_output_does_not_depend_on_who_shares_its_experts(family, dtype):
    """Each token alone, then among 31 others (most sharing one of its experts), then the
    batch reversed: the same bits."""
    if not packed_linear_available(torch.device("cpu"), dtype):
        pytest.skip(f"no prepacked {dtype} products here: plain matmuls move with the batch")
    shape = ROUTERS[family]
    layer, _ = moe_layer(shape, dtype)
    ops = layer_ops(dtype)
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    together = layer(x, ops)
    reversed_ = layer(x.flip(0), ops).flip(0)
    alone = torch.cat([layer(x[i : i + 1], ops) for i in range(32)])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(together.view(bits), alone.view(bits))
    assert torch.equal(together, reversed_)
    _, ids = layer.route(x, ops)
    assert torch.bincount(ids.flatten(), minlength=EXPERTS).max() > 8  # experts were shared


def test_tokens_routed_to_each_expert_are_counted():
    shape = dataclasses.replace(ROUTERS["deepseek_v3"])
    layer, _ = moe_layer(shape)
    ops = layer_ops(torch.float32)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3))
    layer(x, ops)
    layer(x[:7], ops)
    _, ids = layer.route(x, ops)
    _, first = layer.route(x[:7], ops)
    expected = torch.bincount(torch.cat([ids.flatten(), first.flatten()]), minlength=EXPERTS)
    assert layer.counts.tolist() == expected.tolist()
    assert int(layer.counts.sum()) == (50 + 7) * shape.top_k
