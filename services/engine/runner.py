"""The model runner: the device side of a step.

It sizes and owns the KV pool (from --num-blocks, --kv-cache-gb or the device's free memory:
pool_budget.py; a pool for each cache group released early: group_pool.py), builds a step's
batch from its scheduled chunks (with the tokens still on the device fed in where the host
holds placeholders), runs the forward pass (replayed from a CUDA graph where one fits and the
model can be captured), and samples: the tokens stay on the device until the host asks.
"""

from __future__ import annotations

import torch

from services.engine.graphs import DecodeGraphs
from services.engine.group_pool import GroupPool, pool_sizes
from services.engine.pool_budget import kv_budget
from services.engine.prompt_scores import scores_prompt
from services.engine.request import Sequence
from services.engine.sampler import LogprobRows, Sampler
from services.engine.scheduler import ScheduledChunk
from services.model import kv_cache
from services.model.batch import ForwardBatch, ImageRows, SeqChunk, on_device
from services.model.causal_lm import CausalLM
from services.model.kv_cache import KVCache
from services.settings import EngineConfig

PLACEHOLDER = -1  # a token sampled on the device, not yet on the host


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, sampler: Sampler) -> None:
        self.model, self.config, self.sampler = model, config, sampler
        mc = model.config
        itemsize = model.embed.element_size()
        budget = 0 if config.num_blocks else kv_budget(mc, config, itemsize, model.device)
        self.num_blocks, group_blocks = pool_sizes(mc.cache_spec, config, itemsize, budget)
        self.kv: KVCache = model.new_kv_cache(self.num_blocks, config.block_size, group_blocks)
        self.graphs: DecodeGraphs | None = None
        on_gpu = model.kernels == "triton" and model.device.type == "cuda"
        if on_gpu and config.cuda_graph_max_batch > 0 and model.capabilities.cuda_graphs:
            self.graphs = DecodeGraphs(model, self.kv, config.cuda_graph_max_batch)

    def group_pools(self) -> list[GroupPool]:
        """A pool for each cache group released early, over its blocks' table (the block
        manager owns them)."""
        return [
            GroupPool(g.group.name, g.num_blocks, g.table, g.group.keep or 0, self.kv.block_size)
            for g in self.kv.mapped
            if g.table is not None
        ]

    def namespace(self) -> str:
        """The block-hash namespace of this model's layout, for a runner outside a worker."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        return kv_cache.layout(
            "model", dtype, self.config.block_size, self.model.config
        ).namespace()

    def prepare(
        self, chunks: list[ScheduledChunk], fed: torch.Tensor | None, fed_seqs: list[Sequence]
    ) -> ForwardBatch:
        """The chunks' batch. `fed` [R]: the last step's tokens, still on the device, row i the
        token of fed_seqs[i]: put where a chunk ends on its sequence's placeholder. (Built
        before the host touches the sequences again: it reads their tokens.)"""
        batch = self.batch(chunks)
        if fed is not None:
            self._feed(batch, chunks, fed, fed_seqs)
        return batch

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of the batch's sampled rows (every row of a scored prompt or one that
        carries proposals)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.forward(batch)
        return self.model.forward(batch, self.kv)

    def batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        return ForwardBatch.build(
            [
                SeqChunk(
                    [*c.seq.token_ids[c.start : c.start + c.num_tokens - len(c.draft)], *c.draft],
                    c.start,
                    c.seq.block_ids,
                    c.want_logits,
                    all_logits=scores_prompt(c.seq) or bool(c.draft),
                    tables=self.kv.tables(c.seq.block_ids),
                    images=image_rows(c.seq, c.start),
                )
                for c in chunks
            ],
            self.config.block_size,
            self.model.device,
        )

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], ahead: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, LogprobRows | None]:
        """Row i's token (of seqs[i] followed by the proposals `ahead[i]`), on the device [R],
        and what the rows' logprobs are read from."""
        tokens = self.sampler.choose(logits, seqs, ahead)
        return tokens, self.sampler.logprob_rows(logits, [s.params for s in seqs])

    def _feed(
        self,
        batch: ForwardBatch,
        chunks: list[ScheduledChunk],
        fed: torch.Tensor,
        fed_seqs: list[Sequence],
    ) -> None:
        row_of = {id(seq): r for r, seq in enumerate(fed_seqs)}
        at, rows, offset = [], [], 0
        for c in chunks:
            if c.seq.token_ids[-1] == PLACEHOLDER and c.start + c.num_tokens == c.seq.num_tokens:
                at.append(offset + c.num_tokens - 1)
                rows.append(row_of[id(c.seq)])
            offset += c.num_tokens
        if at:
            index, picked = on_device(torch.tensor([at, rows]), batch.token_ids.device)
            batch.token_ids.index_copy_(0, index, fed.index_select(0, picked))


def image_rows(seq: Sequence, start: int) -> tuple[ImageRows, ...]:
    """The images of a sequence whose prompt is still being computed from `start`."""
    if not seq.images or start >= seq.prompt_len:
        return ()
    return tuple(ImageRows(i.span.start, i.embeds, seq.whole_images) for i in seq.images)
