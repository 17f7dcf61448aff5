"""The engine: requests in, tokens out, one forward pass per step.

    step = schedule -> run the model on the scheduled chunks -> sample -> apply the tokens

With speculative decoding on, a decoding sequence's chunk carries proposed tokens too, and
applying its tokens keeps the accepted run (services/engine/speculative.py).

Workers drive `add_request` / `step` / `abort` from their serving loop; `generate` runs the
same loop to completion for offline use.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from services.engine import offline
from services.engine.block_manager import BlockManager
from services.engine.graphs import DecodeGraphs
from services.engine.group_pool import GroupPool, pool_sizes
from services.engine.kv_connector import BlockToSave, KVConnector, KVConnectorWorker
from services.engine.outputs import (
    RequestOutput,
    SequenceDelta,
    StepTimes,
    StepTiming,
    StopChecker,
)
from services.engine.overlap import PLACEHOLDER, Overlap, SpecOverlap, async_scheduling
from services.engine.params import SamplingParams, ValidationError, validate_prompt
from services.engine.pool_budget import kv_budget
from services.engine.prompt_scores import score_prompts, scores_prompt
from services.engine.request import (
    EngineRequest,
    FinishReason,
    Sequence,
    Status,
    TokenLogprobs,
)
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledChunk, Scheduler
from services.engine.seeds import choice_seed
from services.engine.speculative import Speculator, draft_proposer
from services.engine.structured import Grammars
from services.model import kv_cache
from services.model.allocator import keep_freed_memory
from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import CausalLM, MtpLayer
from services.settings import EngineConfig
from services.tokenizer.detokenize import IncrementalDetokenizer
from services.tokenizer.tokenizer import Tokenizer


@dataclass
class _Request:
    seqs: list[Sequence]
    held_back: list[Sequence] = field(default_factory=list)  # choices 1..n-1 before prefill
    connector: KVConnector | None = None  # its KV beyond the engine (kv_connector.py)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        draft: CausalLM | MtpLayer | None = None,
        namespace: str | None = None,
        kv_connector: KVConnectorWorker | None = None,
    ) -> None:
        """`draft`: the draft model (same tokenizer) or MTP layer, for speculative `draft`/`mtp`;
        `namespace`: the block-hash namespace (a worker's: block names in the engine are keys
        in its store); None: the model's layout. `kv_connector`: the worker half of the KV
        seam, which loads and saves the blocks requests' connectors ask for."""
        keep_freed_memory()  # each step's temporaries reuse the last one's pages (allocator.py)
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        mc = model.config
        itemsize = model.embed.element_size()
        budget = 0 if config.num_blocks else kv_budget(mc, config, itemsize, model.device)
        num_blocks, group_blocks = pool_sizes(mc.cache_spec, config, itemsize, budget)
        self.kv = model.new_kv_cache(num_blocks, config.block_size, group_blocks)
        pools = [
            GroupPool(g.group.name, g.num_blocks, g.table, g.group.keep or 0, config.block_size)
            for g in self.kv.mapped
            if g.table is not None
        ]
        self.graphs: DecodeGraphs | None = None
        on_gpu = model.kernels == "triton" and model.device.type == "cuda"
        if on_gpu and config.cuda_graph_max_batch > 0 and model.capabilities.cuda_graphs:
            self.graphs = DecodeGraphs(model, self.kv, config.cuda_graph_max_batch)
        dtype = str(model.dtype).removeprefix("torch.")
        namespace = namespace or kv_cache.layout("model", dtype, config.block_size, mc).namespace()
        self.blocks = BlockManager(
            num_blocks, config.block_size, namespace, config.enable_prefix_caching, pools
        )
        self.speculator: Speculator | None = None
        if config.speculative.enabled:
            drafter = draft_proposer(config.speculative, draft, model, num_blocks,
                                     config.block_size)  # fmt: skip
            self.speculator = Speculator(config.speculative, mc.max_model_len, drafter)
        self.scheduler = Scheduler(config, self.blocks, self._admit, self.speculator)
        self.grammars = Grammars(tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.sampler = Sampler(mc.vocab_size, mc.eos_token_ids, self.grammars)
        self.kv_connector = kv_connector
        self.requests: dict[str, _Request] = {}
        self.times = StepTimes()
        self._arrivals = itertools.count()
        self.overlap: Overlap | None = None  # services/engine/overlap.py
        if async_scheduling(config.async_scheduling, model.device):
            self.overlap = Overlap(self) if self.speculator is None else SpecOverlap(self)

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineRequest, connector: KVConnector | None = None) -> None:
        """Queue a request, or raise ValidationError (nothing queued) if it cannot be run.
        `connector`: the scheduler half of its KV beyond the engine (needs `kv_connector`)."""
        assert connector is None or self.kv_connector is not None, "no worker half to move KV"
        request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
        output_ids, salt = request.output_ids, request.salt
        mc = self.model.config
        params.validate(mc.vocab_size)
        validate_prompt(prompt_ids, mc.vocab_size, mc.max_model_len, params.max_tokens)
        if request_id in self.requests:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        if len(output_ids) >= params.max_tokens:
            raise ValidationError("output_token_ids", "already max_tokens long")
        need = -(-(len(prompt_ids) + params.max_tokens) // self.config.block_size)
        if need > self.blocks.num_blocks:
            raise ValidationError(
                "max_tokens",
                f"prompt plus max_tokens needs {need} KV blocks; the pool has "
                f"{self.blocks.num_blocks}",
            )
        grammar = params.grammar
        matcher = None if grammar is None else self.grammars.matcher(grammar, output_ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        context = [*prompt_ids, *output_ids]
        seqs = [
            Sequence(
                request_id=request_id,
                index=i,
                prompt_len=len(prompt_ids),
                token_ids=list(context),
                params=params,
                seed=choice_seed(seed, i),
                arrival=next(self._arrivals),
                salt=salt,
                detokenizer=self._detokenizer(prompt_ids, output_ids, params),
                block_hashes=list(
                    request.block_hashes[: len(prompt_ids) // self.config.block_size]
                ),
                matcher=matcher if i == 0 or matcher is None else matcher.deep_copy(),
            )
            for i in range(params.n)
        ]
        for seq in seqs:  # text of earlier output: not sent again, but stop strings see it
            assert seq.detokenizer is not None
            seq.text = seq.detokenizer.text
            seq.emitted_chars = (
                len(seq.text)
                if request.text_sent is None
                else min(request.text_sent, len(seq.text))
            )
        self.requests[request_id] = _Request(seqs, seqs[1:], connector)
        # Choices 1..n-1 wait until choice 0 has computed the prompt; they then find its
        # full blocks in the prefix cache and share them instead of computing them again.
        self.scheduler.add(seqs[0])

    def _detokenizer(
        self, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        detok = self.tokenizer.detokenizer(prompt_ids, params.skip_special_tokens)
        for token in output_ids:
            detok.add([token])
        return detok

    def _admit(self, seq: Sequence) -> int:
        """The computed prefix of a sequence entering the batch: what its connector brings,
        or the prefix cache's; nothing for a prompt being scored (its logits are needed).
        0 with no blocks given when the pool is short for the connector's prefix."""
        if scores_prompt(seq):
            seq.prompt_logprobs.clear()  # preempted before its first token: scored again
            return 0
        connector = self._connector(seq)
        prefix = connector.prefix(seq) if connector is not None else None
        if prefix is None:
            return self.blocks.admit(seq)
        items = self.blocks.admit_external(
            seq, prefix.hashes, prefix.partial_tokens, prefix.skipped
        )
        if items is None:
            return 0
        if items:
            assert self.kv_connector is not None
            self.kv_connector.load(self.kv, prefix.source, items)
        assert connector is not None
        connector.admitted(self.blocks, seq)
        return seq.num_computed_tokens

    def _connector(self, seq: Sequence) -> KVConnector | None:
        req = self.requests.get(seq.request_id)
        return req.connector if req is not None else None

    def _save(self, seq: Sequence, blocks: list[BlockToSave]) -> None:
        if blocks:
            assert self.kv_connector is not None
            self.kv_connector.save(self.kv, seq, blocks)

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Stop a request now; its blocks return to the pool before this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        deltas = []
        for seq in req.seqs:
            if not seq.is_finished:
                if seq.token_ids[-1] == PLACEHOLDER:  # its token still on the device: dropped
                    seq.token_ids.pop()
                self._finish(seq)
                seq.finish_reason = FinishReason.ABORT
                deltas.append(SequenceDelta.finished_only(seq))
        return deltas

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the loop --------------------------------------------------------------------

    def step(self) -> list[SequenceDelta]:
        """One forward pass; what each sequence gained from it (tokens, text, finishing).
        With async scheduling, the tokens of the pass before (this one's stay on the device)."""
        if self.overlap is not None:
            return self.overlap.step()
        t0, start_ns = time.perf_counter(), time.time_ns()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        batch = self._batch(scheduled.chunks)
        t1 = time.perf_counter()
        logits = self._forward(batch)
        if self.speculator is not None:  # an MTP layer drafts from the target's hidden rows
            self.speculator.observe(scheduled.chunks, self.model)
        t2 = time.perf_counter()
        timing = StepTiming(start_ns, time.time_ns(), len(scheduled.chunks), scheduled.num_tokens)
        for chunk in scheduled.chunks:
            chunk.seq.scheduled_ns = chunk.seq.scheduled_ns or start_ns
            if not chunk.draft:  # a draft's KV counts once verified (_verify)
                self._computed(chunk.seq, chunk.start + chunk.num_tokens)
        sampling = [c for c in scheduled.chunks if c.want_logits]
        # one row per sampled token: a chunk's last, or its last and each proposed one's
        rows = [(c.seq, c.draft[:j]) for c in sampling for j in range(len(c.draft) + 1)]
        logits = score_prompts(scheduled.chunks, logits)
        result = self.sampler(logits, [s for s, _ in rows], [a for _, a in rows])
        deltas, r = [], 0
        for c in sampling:
            n = len(c.draft) + 1
            tokens, lps = result.token_ids[r : r + n], result.logprobs[r : r + n]
            if c.draft:
                deltas.append(self._verify(c, logits[r : r + n], tokens, lps, timing))
            else:
                deltas.append(self._apply(c.seq, tokens[0], lps[0], timing))
            r += n
        self.times.steps += 1
        self.times.schedule += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += time.perf_counter() - t2
        return deltas

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.forward(batch)
        return self.model.forward(batch, self.kv)

    def _computed(self, seq: Sequence, num_computed: int) -> None:
        """seq's KV now holds its first `num_computed` tokens: name its full blocks."""
        seq.num_computed_tokens = num_computed
        self.blocks.commit(seq)
        connector = self._connector(seq)
        if connector is not None:
            self._save(seq, connector.computed(self.blocks, seq))
        self.blocks.slide(seq)

    def _verify(
        self,
        chunk: ScheduledChunk,
        logits: torch.Tensor,
        targets: list[int],
        logprobs: list[TokenLogprobs | None],
        step: StepTiming,
    ) -> SequenceDelta:
        """Keep the proposed tokens the target accepts, then its next one; roll back the KV
        of the rest. One delta for all the tokens the sequence gained. logits: the chunk's
        rows [k + 1, vocab]; targets, logprobs: the target's draws at them."""
        seq = chunk.seq
        assert self.speculator is not None
        kept = self.speculator.keep(seq, chunk.draft, logits, targets, logprobs, self.sampler)
        accepted = len(kept) - 1
        deltas = []
        for j in range(accepted + 1):  # stops, EOS and max_tokens cut the run where they fall
            self._computed(seq, chunk.start + 1 + j)  # the last token and draft[:j]
            deltas.append(self._apply(seq, kept[j], logprobs[j], step))
            if seq.finish_reason is not None:
                break
        if not seq.is_finished:
            self.blocks.truncate(seq)
        return SequenceDelta.merge(deltas)

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        return ForwardBatch.build(
            [
                SeqChunk(
                    [*c.seq.token_ids[c.start : c.start + c.num_tokens - len(c.draft)], *c.draft],
                    c.start,
                    c.seq.block_ids,
                    c.want_logits,
                    all_logits=scores_prompt(c.seq) or bool(c.draft),
                    tables=self.kv.tables(c.seq.block_ids),
                )
                for c in chunks
            ],
            self.config.block_size,
            self.model.device,
        )

    def _apply(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, step: StepTiming,
        placed: bool = False, advanced: bool = False,
    ) -> SequenceDelta:  # fmt: skip
        """`placed`: the token is already the sequence's last; `advanced`: its grammar has
        taken it (async scheduling's)."""
        if not placed:
            seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.matcher is not None and not advanced:
            self.grammars.advance(seq.matcher, token)
        connector = self._connector(seq)
        delta = self._stops(seq).apply(token, step, self._hands_off(seq))
        if seq.finish_reason is not None:
            if connector is not None:  # before its blocks are released
                self._save(seq, connector.finished(self.blocks, seq))
            self._finish(seq)
        if seq.index == 0 and seq.num_output_tokens == 1:
            self._release_held_back(seq.request_id)
        req = self.requests.get(seq.request_id)
        if req is not None and all(s.is_finished for s in req.seqs):
            del self.requests[seq.request_id]
        return delta

    def _stops(self, seq: Sequence) -> StopChecker:
        return StopChecker(seq, self.sampler.eos_token_ids, self.model.config.max_model_len)

    def _hands_off(self, seq: Sequence) -> bool:
        connector = self._connector(seq)
        return connector is not None and connector.hands_off(seq)

    def _release_held_back(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.held_back:
            self.scheduler.add(seq)
        req.held_back = []

    # -- offline ---------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Seq[int] | str], params: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts (token ids or text) to completion; outputs in the prompts' order."""
        return offline.generate(self, prompts, params, f"offline-{next(self._arrivals)}")

    def check(self) -> None:
        """The pool's invariants, and that its references are exactly the running sequences'
        block tables."""
        self.blocks.check()
        holders = [s for r in self.requests.values() for s in r.seqs if s.block_ids]
        assert all(s.status is Status.RUNNING for s in holders), "a non-running seq holds blocks"
        held = sum(len(s.block_ids) for s in holders)
        assert held == sum(b.ref_count for b in self.blocks.blocks), "references leak"


__all__ = ["Engine", "EngineConfig", "StepTimes"]
