"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels; at small batches the GPU waits on the
launches, not the arithmetic. A graph records one step's launches once and replays them with
one call. Its inputs live in static tensors sized for the bucket: a step of B sequences
copies its tokens, positions, slots, block tables and context lengths into the first B rows
of the smallest bucket >= B, and the rest are padding that computes and writes nothing (slot
-1: no KV written; context length 0: attention's output 0). Graphs are captured lazily, the
first time a bucket is needed, and cover contexts up to `max_context` tokens (the decode
kernel's splits are fixed at capture); longer steps and steps with prompt chunks run eagerly.

Only with the Triton kernels on a CUDA device: their plan for a decode-only batch reads the
batch's tensors and nothing from the host, which is what a replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model.batch import ForwardBatch
from services.model.causal_lm import CausalLM
from services.model.kv_cache import KVCache

MAX_CONTEXT = 8192  # tokens a captured step covers per sequence, at most


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch] if max_batch > 0 else []


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # its static inputs
    logits: torch.Tensor  # its static output


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_batch: int) -> None:
        assert model.device.type == "cuda" and model.kernels == "triton"
        self.model = model
        self.kv = kv
        self.sizes = buckets(max_batch)
        capacity = min(model.config.max_position_embeddings, kv.num_blocks * kv.block_size)
        self.max_blocks = -(-min(capacity, MAX_CONTEXT) // kv.block_size)
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket
        self.replays = 0

    def fits(self, batch: ForwardBatch) -> bool:
        """A step of decode tokens only, each wanting its logits, within the buckets."""
        n = len(batch.seqs)
        return (
            0 < n <= (self.sizes[-1] if self.sizes else 0)
            and batch.max_query_len == 1
            and batch.logits_rows.shape[0] == n
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits [B, vocab] model.forward would give for a batch that fits."""
        n = len(batch.seqs)
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs.get(size) or self._capture(size)
        fill(g.batch, batch)
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]

    def _capture(self, size: int) -> _Graph:
        static = static_batch(size, self.max_blocks, self.kv.block_size, self.model.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels, warms the allocator
            for _ in range(2):
                self.model.forward(static, self.kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(static, self.kv)
        self.graphs[size] = _Graph(graph, static, logits)
        return self.graphs[size]


def static_batch(size: int, max_blocks: int, block_size: int, device: torch.device) -> ForwardBatch:
    """A graph's inputs: `size` decode rows, all padding (slot -1, context 0) until filled;
    the decode kernel's splits cover `max_blocks` blocks."""

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.int64, device=device)

    rows = torch.arange(size, dtype=torch.int64, device=device)
    return ForwardBatch(
        token_ids=zeros(size),
        positions=zeros(size),
        slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
        seqs=(),
        logits_rows=rows,
        block_size=block_size,
        block_tables=zeros(size, max_blocks),
        seq_rows=rows,
        query_lens=torch.ones(size, dtype=torch.int64, device=device),
        context_lens=zeros(size),
        max_query_len=1,
        max_context_len=max_blocks * block_size,
    )


def fill(static: ForwardBatch, batch: ForwardBatch) -> None:
    """Copy a decode-only batch into the first rows of a static one; the rest is padding."""
    n = len(batch.seqs)
    static.token_ids[:n].copy_(batch.token_ids)
    static.positions[:n].copy_(batch.positions)
    static.slot_mapping[:n].copy_(batch.slot_mapping)
    static.slot_mapping[n:].fill_(-1)
    static.context_lens[:n].copy_(batch.context_lens)
    static.context_lens[n:].zero_()
    static.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
