"""Exact tensor parallelism for the Llama family's dense models (docs/parallel.md).

M ranks (processes) each hold a slice of every product by its output columns: its query and
KV heads (and their KV cache), its columns of o, of the MLP's gate/up and down, and of the
head's vocabulary. Where a product needs its whole input (o reads every head's output, down
every MLP column), the ranks all-gather the input; where the next step needs the whole output
(the residual stream, the logits), they all-gather the output. No output is ever summed from
partial sums, so each is one rank's whole sum in the order one process takes
(tests/services/model/test_linear.py: a slice of the columns gives the same bits), and a
rank's logits equal one process's bit for bit: greedy and seeded tokens and logprobs do not
depend on M. The embedding is split by vocabulary too (each id's row from the rank holding
it: VocabularySlice); the norms stay whole on every rank.

Every rank runs the same engine on the same requests (SPMD): their batches, and so their
collectives, are the same step by step, because their logits are.

`shard(config, weights, rank, size)` cuts a checkpoint's weights for one rank; `parallelize
(model, group)` puts the exchanges around the products of a model built from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.model import families
from services.model.config import ModelConfig
from services.model.layers.layer_ops import LayerOps
from services.model.layers.linear import Bf16Linear, Linear, bf16_linear_library
from services.model.layers.moe import DenseMlp, Moe, fused_swiglu, run_grouped, swiglu_bf16
from services.model.parallel.plan import slices


@dataclass(frozen=True)
class TensorGroup:
    """The ranks of one tensor-parallel group, this process's place among them."""

    group: Any  # a torch.distributed process group (gloo on CPUs, NCCL on GPUs)
    rank: int
    size: int

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x side by side along `dim` (the last by default), rank 0's first."""
        x = x.contiguous()
        wire = x.view(torch.uint8)  # the bits as they are, in any dtype gloo knows or not
        parts = [torch.empty_like(wire) for _ in range(self.size)]
        self.group.allgather([parts], [wire]).wait()
        return torch.cat([p.view(x.dtype) for p in parts], dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank (x: rank 0's tensor, or one of its shape and dtype)."""
        wire = x.contiguous().view(torch.uint8)
        self.group.broadcast([wire], dist.BroadcastOptions()).wait()
        return wire.view(x.dtype)


def shard(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """One rank's config (its heads) and weights (its columns) of a model read whole;
    ValueError where the model does not split into `size` exact parts (`check`). The loader
    reads only the rows `slices` names instead (`sliced`)."""
    local = dict(weights)
    for name, rows in slices(config, rank, size).items():
        if name in weights:
            local[name] = weights[name][rows].contiguous()
    return sliced(config, local, rank, size)


def sliced(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A rank's config, and its weights from its slices (`slices`' rows, read or cut): a
    tied head is the embedding's rows, this rank's vocabulary."""
    own = families.of(config).tensor_module()
    if own is not None:
        return own.sliced(config, weights, rank, size)
    return default_sliced(config, weights, size)


def default_sliced(
    c: ModelConfig, weights: dict[str, torch.Tensor], size: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`sliced` for the Llama family and DeepSeek-V2/V3."""
    if c.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    mine = dataclasses.replace(
        c,
        num_heads=c.num_heads // size,
        num_kv_heads=c.num_kv_heads // size,
        tie_word_embeddings=False,  # the head: this rank's vocabulary rows, lm_head above
    )
    return mine, weights


class Gathered:
    """A product by a slice of a weight's output columns between the exchanges it needs."""

    def __init__(self, inner: Linear, group: TensorGroup, whole_input: bool) -> None:
        self.inner, self.group, self.whole_input = inner, group, whole_input

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather(self.inner(self.group.gather(x) if self.whole_input else x))


class TensorMlp:
    """A SwiGLU MLP over a tensor group: this rank's columns of silu(gate) * up, gathered;
    then its columns of down, gathered. Its SiLU products are the one-process MLP's: the
    grouped kernel's (float32 sums, one rounding) where that MLP would take it, else
    gate_up's outputs through silu_mul."""

    def __init__(self, mlp: DenseMlp, group: TensorGroup) -> None:
        self.gate_up, self.down, self.group = mlp.gate_up, mlp.down, group

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.group.gather(self.down(self.group.gather(self._act(x, ops))))

    def _act(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # as DenseMlp chooses for the whole MLP (shard keeps the SiLU's columns in whole
        # groups of 32 on every rank, so the rank's slice is fused where the whole is)
        library = bf16_linear_library()
        bf16_rows = x.dim() == 2 and x.dtype == torch.bfloat16
        if bf16_rows and library is not None and fused_swiglu(self.gate_up, self.down):
            assert isinstance(self.gate_up, Bf16Linear)
            return swiglu_bf16(library, self.gate_up, x)
        return ops.silu_mul(self.gate_up(x))


class TensorExperts:
    """A MoE layer's routed experts over a tensor group (a Dispatch): rank j holds experts
    [j E/M, (j+1) E/M). Every rank has the same rows and routes them alike, so each knows
    which rank computes which choice: it computes its own and the ranks all-gather the
    outputs. Each choice is computed once, by one rank, with one process's bits (moe.py)."""

    def __init__(self, moe: Moe, group: TensorGroup) -> None:
        self.group, self.per_rank = group, moe.shape.num_experts // group.size
        moe.hold(range(group.rank * self.per_rank, (group.rank + 1) * self.per_rank))
        moe.dispatch = self

    def compute(
        self, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        g, k = self.group, len(experts) // len(x) if len(x) else 1
        order = experts.argsort(stable=True)  # the choices by expert, so by rank
        counts = torch.bincount(experts // self.per_rank, minlength=g.size).tolist()
        start = sum(counts[: g.rank])
        mine = order[start : start + counts[g.rank]]
        out = run_grouped(
            x.index_select(0, mine // k), 1, experts[mine] - g.rank * self.per_rank,
            moe.slots, ops,
        )  # fmt: skip
        widest = max(counts)  # the gather takes equal parts: each padded to the widest
        if widest == 0:  # no rows (every rank knows)
            return out
        padded = torch.cat([out, out.new_zeros(widest - len(out), *out.shape[1:])])
        parts = g.gather(padded, dim=0).split(widest)
        per_choice = torch.empty(len(experts), *out.shape[1:], dtype=out.dtype, device=out.device)
        per_choice[order] = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])
        return per_choice


class VocabularySlice:
    """The embedding over a tensor group: rank j holds the rows of vocabulary [j V/M,
    (j+1) V/M); each rank looks up the ids it holds (zeros for the others), the ranks
    all-gather their rows, and each id takes its owner's row: the bits one process looks up,
    never a sum."""

    def __init__(self, embed: torch.Tensor, group: TensorGroup, vocab: int) -> None:
        self.embed, self.group, self.per_rank = embed, group, vocab // group.size

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        g, hidden = self.group, self.embed.shape[1]
        owner = ids // self.per_rank
        mine = owner == g.rank
        rows = self.embed.new_zeros(len(ids), hidden)
        rows[mine] = self.embed.index_select(0, ids[mine] - g.rank * self.per_rank)
        every = g.gather(rows, dim=0).view(g.size, len(ids), hidden)
        return every[owner, torch.arange(len(ids), device=ids.device)]


def parallelize(model: Any, group: TensorGroup, experts: bool = True) -> None:
    """The exchanges around a model built from `shard`'s weights: o and down read gathered
    inputs, their outputs and the logits are gathered, each MoE layer keeps this rank's
    experts (in place; `experts` False: the layers are left whole, for a data-parallel
    grid's exchange to spread, parallel/data.py)."""
    own = families.of(model.config).tensor_module()
    if own is not None:
        own.parallelize(model, group, experts)
        return
    default_parallelize(model, group, experts)


def default_parallelize(model: Any, group: TensorGroup, experts: bool) -> None:
    """`parallelize` for the Llama family and DeepSeek-V2/V3."""
    for i, layer in enumerate(model.layers):
        attention = dataclasses.replace(
            layer.attention, o=Gathered(layer.attention.o, group, whole_input=True)
        )
        if isinstance(layer.mlp, Moe):  # its router and shared experts whole on every rank
            if experts:
                TensorExperts(layer.mlp, group)
            model.layers[i] = dataclasses.replace(layer, attention=attention)
            continue
        assert isinstance(layer.mlp, DenseMlp)
        model.layers[i] = dataclasses.replace(
            layer, attention=attention, mlp=TensorMlp(layer.mlp, group)
        )
    model.lm_head = Gathered(model.lm_head, group, whole_input=False)
    model.lookup = VocabularySlice(model.embed, group, model.config.vocab_size)
