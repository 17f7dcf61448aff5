"""Mixture-of-experts MLPs: the router, routed experts computed grouped, shared experts.

One layer serves Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3; config.MoeShape says how
each routes. The routed experts run grouped: the (token, choice) pairs are sorted by expert and
each active expert runs one product over its contiguous rows, never a loop over tokens.

Batch invariance: a token's output depends on its own row only. Each expert's products give a
row the same bits at any row count (linear.py's prepacked products, as the dense layers), and
a token sums its experts' outputs in its own choice order, in float32, whoever else chose them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model.config import MoeShape
from services.model.layer_ops import LayerOps
from services.model.linear import Linear


@dataclass(frozen=True)
class DenseMlp:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    gate_up: Linear  # hidden -> 2 ff
    down: Linear  # ff -> hidden

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(x)))


class Moe:
    def __init__(
        self,
        shape: MoeShape,
        gate: Linear,  # hidden -> experts, in `router_dtype`
        router_dtype: torch.dtype,
        correction_bias: torch.Tensor | None,  # [experts] (noaux_tc)
        experts: list[DenseMlp],
        shared: DenseMlp | None,
        shared_gate: Linear | None,  # hidden -> 1 (Qwen2-MoE)
    ) -> None:
        self.shape = shape
        self.gate = gate  # prepacked like every product: a row's logits never depend on the batch
        self.router_dtype = router_dtype
        self.correction_bias = None if correction_bias is None else correction_bias.float()
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate
        # tokens routed to each expert since start (metrics; the balancer's input)
        self.counts = torch.zeros(shape.num_experts, dtype=torch.int64)

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = self.route(x, ops)  # [T, k] float32, [T, k]
        out = self.routed(x, weights, ids, ops)
        if self.shared is not None:
            shared = self.shared(x, ops)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out

    def route(self, x: torch.Tensor, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] and their weights [T, k] (float32)."""
        s = self.shape
        logits = self.gate(x.to(self.router_dtype)).float()  # [T, experts]
        scores = ops.router_scores(logits, sigmoid=s.scoring == "sigmoid")
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if s.topk_method in ("group_limited_greedy", "noaux_tc") and s.n_group > 1:
            choice = self._best_groups(choice)
        ids = choice.topk(s.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's topk_group best groups masked out.
        A group ranks by its best expert (V2) or the sum of its best two (V3's noaux_tc)."""
        s = self.shape
        grouped = choice.view(choice.shape[0], s.n_group, -1)  # [T, groups, per group]
        if s.topk_method == "noaux_tc":
            rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            rank = grouped.amax(dim=-1)
        best = rank.topk(s.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        fill = 0.0 if s.topk_method == "group_limited_greedy" else float("-inf")
        return grouped.masked_fill(~keep[..., None], fill).flatten(1)

    def routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        ops: LayerOps,
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert[ids[t, j]](x[t]), grouped by expert."""
        tokens, k = ids.shape
        flat = ids.flatten()  # [T * k]: choice j of token t at t * k + j
        order = flat.argsort(stable=True)  # the choices, grouped by expert
        counts = torch.bincount(flat, minlength=self.shape.num_experts)
        self.counts += counts.cpu()
        grouped = x.index_select(0, order // k)  # [T * k, hidden], each expert's rows together
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                outputs[rows] = self.experts[expert](grouped[rows], ops)
                start += n
        per_choice = torch.empty_like(outputs)
        per_choice[order] = outputs  # back in (token, choice) order
        summed = (per_choice.view(tokens, k, -1).float() * weights[..., None]).sum(dim=1)
        return summed.to(x.dtype)
