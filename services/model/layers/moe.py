"""Mixture-of-experts MLPs: the router, routed experts computed grouped, shared experts.

One layer serves Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3; config.MoeShape says how
each routes. The routed experts run grouped: the (token, choice) pairs are sorted by expert and
each active expert runs one product over its contiguous rows, never a loop over tokens; in
bfloat16 on AVX512-BF16 CPUs (experts packed by linear.make_linear) the whole layer's
experts run in one C call (`grouped_bf16`), each expert's weights read once; a dense or shared
MLP packed the same way takes the same call, as one expert (gate/up, SiLU and down fused).

Batch invariance: a token's output depends on its own row only. Each expert's products give a
row the same bits at any row count (linear.py's prepacked products, as the dense layers), and
a token sums its experts' outputs in its own choice order, in float32, whoever else chose them.
The same holds across processes: with expert parallelism (expert_parallel.py) a row goes to
whichever slot holds a copy of its expert, on whichever rank, and comes back with the bits it
would have had here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from services.model.config import MoeShape
from services.model.layers.layer_ops import LayerOps
from services.model.layers.linear import Bf16Linear, Linear, bf16_linear_library


@dataclass(frozen=True)
class DenseMlp:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    gate_up: Linear  # hidden -> 2 ff
    down: Linear  # ff -> hidden

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if x.dim() == 2 and (packed := _grouped_library([self], x)) is not None:
            # both products packed for bf16_linear.c: its fused call, as one expert's rows
            rows = torch.arange(x.shape[0])
            return grouped_bf16(*packed, x, 1, rows, torch.tensor([x.shape[0]]))
        return self.down(ops.silu_mul(self.gate_up(x)))


class Dispatch(Protocol):
    """Where a layer's routed rows are computed when its experts are spread over processes
    (expert_parallel.ExpertGroup)."""

    def compute(
        self, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        """Each choice's expert output [T * k, hidden]: choice i is row x[i // k] through
        expert experts[i]."""
        ...


class Moe:
    def __init__(
        self,
        shape: MoeShape,
        gate: Linear,  # hidden -> experts, in `router_dtype`
        router_dtype: torch.dtype,
        correction_bias: torch.Tensor | None,  # [experts] (noaux_tc)
        experts: list[DenseMlp | None],  # None: not built here (`built_experts`)
        shared: DenseMlp | None,
        shared_gate: Linear | None,  # hidden -> 1 (Qwen2-MoE)
        build: Callable[[int], DenseMlp] | None = None,  # expert e, read from the checkpoint
    ) -> None:
        self.shape = shape
        self.gate = gate  # prepacked like every product: a row's logits never depend on the batch
        self.router_dtype = router_dtype
        self.correction_bias = None if correction_bias is None else correction_bias.float()
        self.experts = experts  # by expert id; empty once the layer holds slots (`hold`)
        self.build = build
        self.slot_experts: list[int] = []  # with expert parallelism: this process's slots'
        self.slots: list[DenseMlp] = []  # experts, and each slot's copy
        self.dispatch: Dispatch | None = None  # where rows go (on the rank that routes)
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
        """Each token's expert weights [T, k] (float32) and chosen experts [T, k]."""
        s = self.shape
        logits = self.gate(x.to(self.router_dtype)).float()  # [T, experts]
        scores = ops.router_scores(logits, sigmoid=s.scoring == "sigmoid")
        return ops.router_select(scores, self.correction_bias, s)

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
        if self.counts.device != flat.device:  # kept where the routing runs: no sync a step
            self.counts = self.counts.to(flat.device)
        self.counts.index_add_(0, flat, torch.ones_like(flat))
        if self.dispatch is not None:
            per_choice = self.dispatch.compute(self, x, flat, ops)
        else:
            whole = cast(list[DenseMlp], self.experts)  # a share has a dispatch: all built
            per_choice = run_grouped(x, k, flat, whole, ops)
        summed = (per_choice.view(tokens, k, -1).float() * weights[..., None]).sum(dim=1)
        return summed.to(x.dtype)

    def hold(self, slot_experts: Sequence[int]) -> int:
        """Keep a copy of expert slot_experts[i] in slot i, and no other expert (expert
        parallelism: this process's share). Copies already held move between slots; the
        others are built from the checkpoint. Returns how many were built."""
        held = dict(zip(self.slot_experts, self.slots, strict=True)) or {
            e: expert for e, expert in enumerate(self.experts) if expert is not None
        }
        built = [e for e in set(slot_experts) if e not in held]
        if built:
            assert self.build is not None, "this layer's experts cannot be rebuilt"
            held |= {e: self.build(e) for e in built}
        self.slot_experts = list(slot_experts)
        self.slots = [held[e] for e in slot_experts]
        self.experts = []
        return len(built)


def built_experts(
    n: int, build: Callable[[int], DenseMlp], weights: Mapping[str, torch.Tensor]
) -> list[DenseMlp | None]:
    """A layer's experts 0..n-1 as a family builds them from `weights`: only those the
    weights hold a share of (hf_dir.Weights.experts, a process of spread experts: the others
    None, built by `hold` should a slot take them)."""
    share = getattr(weights, "experts", None)
    return [build(e) if share is None or e in share else None for e in range(n)]


def run_grouped(
    x: torch.Tensor,
    k: int,
    keys: torch.Tensor,
    modules: Sequence[Callable[[torch.Tensor, LayerOps], torch.Tensor]],
    ops: LayerOps,
) -> torch.Tensor:
    """modules[keys[i]](x[i // k]) for every i [len(keys), hidden]: the rows of a key grouped
    (in order) through one call of its module, or of all modules at once where they are
    experts packed for it (`grouped_bf16`)."""
    order = keys.argsort(stable=True)  # the rows, grouped by key
    counts = torch.bincount(keys, minlength=len(modules))
    packed = _grouped_library(modules, x)
    if packed is not None:
        return grouped_bf16(*packed, x, k, order, counts)
    grouped = x.index_select(0, order // k)
    outputs = torch.empty_like(grouped)
    start = 0
    for key, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            outputs[rows] = modules[key](grouped[rows], ops)
            start += n
    out = torch.empty_like(outputs)
    out[order] = outputs  # back in the keys' order
    return out


def _grouped_library(
    modules: Sequence[object], x: torch.Tensor
) -> tuple[ctypes.CDLL, list[tuple[Bf16Linear, Bf16Linear]]] | None:
    """kernels/bf16_linear.c and each module's (gate_up, down) where every module is a SwiGLU
    expert whose products it packed (linear.make_linear) and x is bfloat16, else None."""
    if x.dtype != torch.bfloat16 or not modules:
        return None
    pairs: list[tuple[Bf16Linear, Bf16Linear]] = []
    for m in modules:
        if not isinstance(m, DenseMlp):
            return None
        gate_up, down = m.gate_up, m.down
        if not fused_swiglu(gate_up, down):
            return None
        assert isinstance(gate_up, Bf16Linear) and isinstance(down, Bf16Linear)
        ff = down.in_features  # all experts alike
        if gate_up.out_features != 2 * ff or (pairs and pairs[0][1].in_features != ff):
            return None
        pairs.append((gate_up, down))
    library = bf16_linear_library()
    return None if library is None else (library, pairs)


def fused_swiglu(gate_up: Linear, down: Linear) -> bool:
    """Whether bf16_linear.c's fused SwiGLU takes these products: both packed for it, no
    biases, the SiLU's columns in whole groups of 32 (it takes 32 at a time)."""
    return (
        isinstance(gate_up, Bf16Linear)
        and isinstance(down, Bf16Linear)
        and gate_up.bias is None
        and down.bias is None
        and gate_up.out_features // 2 % 32 == 0
    )


def swiglu_bf16(library: ctypes.CDLL, gate_up: Bf16Linear, x: torch.Tensor) -> torch.Tensor:
    """bfloat16(silu(gate) * up) of x [T, hidden] bfloat16 (bf16_swiglu): the first half of
    grouped_bf16's MLP alone, bit for bit."""
    x = x.contiguous()
    act = torch.empty(x.shape[0], gate_up.out_features // 2, dtype=torch.bfloat16)
    if x.shape[0]:
        library.bf16_swiglu(
            x.data_ptr(), gate_up.packed.data_ptr(), act.data_ptr(), x.shape[0], x.shape[1],
            act.shape[1],
        )  # fmt: skip
    return act


def grouped_bf16(
    library: ctypes.CDLL,
    experts: list[tuple[Bf16Linear, Bf16Linear]],  # each module's gate_up and down
    x: torch.Tensor,  # [T, hidden] bfloat16
    k: int,
    order: torch.Tensor,  # [n]: the choices, grouped by module (argsort of the keys)
    counts: torch.Tensor,  # [modules]: choices per module
) -> torch.Tensor:  # [n, hidden] bfloat16, in the keys' order
    """Every module's rows through its gate/up, SiLU and down in one call (bf16_experts): each
    module's weights read once, the threads over (module, columns) pieces, each result
    written to its choice's row."""
    x = x.contiguous()
    n, ff = len(order), experts[0][1].in_features
    start = torch.zeros(len(experts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=start[1:])
    src = (order // k).contiguous()  # the row of x each grouped choice reads
    gate_up = torch.tensor([g.packed.data_ptr() for g, _ in experts], dtype=torch.int64)
    down = torch.tensor([d.packed.data_ptr() for _, d in experts], dtype=torch.int64)
    act = torch.empty(n, ff, dtype=torch.bfloat16)
    out = torch.empty(n, x.shape[1], dtype=torch.bfloat16)  # in the keys' order
    library.bf16_experts(
        x.data_ptr(), src.data_ptr(), order.data_ptr(), start.data_ptr(), len(experts),
        gate_up.data_ptr(), down.data_ptr(), act.data_ptr(), out.data_ptr(), x.shape[1], ff,
    )  # fmt: skip
    return out
