"""Exact tensor parallelism for the Llama family's dense models (docs/parallel.md).

M ranks (processes) each hold a slice of every product by its output columns: its query and
KV heads (and their KV cache), its columns of o, of the MLP's gate/up and down, and of the
head's vocabulary. Where a product needs its whole input (o reads every head's output, down
every MLP column), the ranks all-gather the input; where the next step needs the whole output
(the residual stream, the logits), they all-gather the output. No output is ever summed from
partial sums, so each is one rank's whole sum in the order one process takes
(tests/services/model/test_linear.py: a slice of the columns gives the same bits), and a
rank's logits equal one process's bit for bit: greedy and seeded tokens and logprobs do not
depend on M. The embedding and the norms stay whole on every rank.

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

from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape
from services.model.layers.layer_ops import LayerOps
from services.model.layers.linear import Bf16Linear, Linear, bf16_linear_library
from services.model.layers.moe import DenseMlp, Moe, fused_swiglu, run_grouped, swiglu_bf16

SWIGLU_COLUMNS = 32  # the grouped kernel's SiLU takes 32 columns at a time


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


def check(config: ModelConfig, size: int) -> None:
    """ValueError, naming each size that does not divide, where the model does not split into
    `size` exact parts."""
    from services.model import families

    c = config
    sizes = [
        ("num_kv_heads", c.num_kv_heads, 1),
        ("hidden_size", c.hidden_size, 16),
        ("vocab_size", c.vocab_size, 16),
    ]
    if any(not c.is_moe_layer(i) for i in range(c.num_layers)):
        sizes.append(("intermediate_size", c.intermediate_size, SWIGLU_COLUMNS))
    if c.moe is not None and c.moe.layers:
        sizes.append(("num_experts", c.moe.num_experts, 1))
    problems = [
        f"{name} ({n}) is not a multiple of {size * unit}"
        for name, n, unit in sizes
        if n % (size * unit)
    ]
    if not families.of(c).model.endswith((":DecoderModel", ":DeepseekModel")):
        problems.append(
            f"{c.architecture}: tensor parallelism covers the Llama family's decoder "
            "(Llama, Mistral, Qwen2/3, Qwen MoE, Mixtral) and DeepSeek-V2/V3"
        )
    if problems:
        raise ValueError("--tensor-parallel " + str(size) + ": " + "; ".join(problems))


def shard(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """One rank's config (its heads) and weights (its columns) of a dense Llama-family model;
    ValueError where the model does not split into `size` exact parts (`check`)."""
    check(config, size)
    c = config
    ff = c.intermediate_size

    def part(t: torch.Tensor, total: int) -> torch.Tensor:
        step = total // size  # rows of this rank's slice, of `total` along dim 0
        return t[rank * step : (rank + 1) * step].contiguous()

    local = dict(weights)
    head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"
    local["lm_head.weight"] = part(weights[head + ".weight"], c.vocab_size)
    heads_of = _mla_heads(c) if isinstance(c.shape, MlaShape) else _gqa_heads(c)
    for i in range(c.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name, total in heads_of(a):
            if name in weights:
                local[name] = part(weights[name], total)
        local[a + "o_proj.weight"] = part(weights[a + "o_proj.weight"], c.hidden_size)
        if c.is_moe_layer(i):
            continue  # the experts whole here: parallelize keeps this rank's share
        for x in ("gate_proj", "up_proj"):
            local[m + x + ".weight"] = part(weights[m + x + ".weight"], ff)
        local[m + "down_proj.weight"] = part(weights[m + "down_proj.weight"], c.hidden_size)
    mine = dataclasses.replace(
        c,
        num_heads=c.num_heads // size,
        num_kv_heads=c.num_kv_heads // size,
        tie_word_embeddings=False,  # the head: this rank's vocabulary rows, lm_head above
    )
    return mine, local


def _gqa_heads(c: ModelConfig) -> Any:
    """Each query and KV head's rows of q, k and v (weights and biases): (name, rows)."""

    def of(a: str) -> list[tuple[str, int]]:
        heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
        return [
            (f"{a}{x}_proj.{kind}", n * c.head_dim)
            for x, n in heads.items()
            for kind in ("weight", "bias")
        ]

    return of


def _mla_heads(c: ModelConfig) -> Any:
    """Latent attention split as vLLM splits it: each head's rows of the query's up-projection
    (q_b, or q without LoRA) and of kv_b (its keys' and values' up-projection); the latent
    (q_a, kv_a and their norms) whole on every rank, and so its cache."""
    m = c.shape
    assert isinstance(m, MlaShape)
    qk, kv = m.nope_dim + m.rope_dim, m.nope_dim + m.v_dim
    query = "q_b_proj" if m.q_lora_rank is not None else "q_proj"

    def of(a: str) -> list[tuple[str, int]]:
        heads = c.num_heads
        return [(f"{a}{query}.weight", heads * qk), (f"{a}kv_b_proj.weight", heads * kv)]

    return of


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


def parallelize(model: Any, group: TensorGroup, experts: bool = True) -> None:
    """The exchanges around a model built from `shard`'s weights: o and down read gathered
    inputs, their outputs and the logits are gathered, each MoE layer keeps this rank's
    experts (in place; `experts` False: the layers are left whole, for a data-parallel
    grid's exchange to spread, parallel/data.py)."""
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
