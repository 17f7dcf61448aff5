"""The engine: requests in, tokens out, one forward pass per step.

    step = schedule -> run the scheduled chunks (runner.py) -> apply the tokens (inflight.py)

The model runner owns the device side (the pool, the batch, the forward pass, sampling); the
tokens it samples are placed and applied on the host (apply.py), at once or, with async
scheduling, while the next pass computes. With speculative decoding on, a decoding sequence's
chunk carries proposed tokens too, and placing its tokens keeps the accepted run
(services/engine/speculative.py).

Workers drive `add_request` / `step` / `abort` from their serving loop; `generate` runs the
same loop to completion for offline use.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence as Seq

import torch

from services.engine import offline
from services.engine.apply import Applier, LiveRequest
from services.engine.block_manager import BlockManager
from services.engine.chunk_reuse import APPROXIMATE, ChunkReuse, validate_chunks
from services.engine.images import PromptImage, validate_images
from services.engine.inflight import InFlight, Sampled, async_scheduling
from services.engine.kv_connector import BlockToSave, KVConnector, KVConnectorWorker
from services.engine.outputs import RequestOutput, SequenceDelta, StepTimes, StepTiming
from services.engine.params import SamplingParams, ValidationError, validate_prompt
from services.engine.prompt_scores import score_prompts, scores_prompt
from services.engine.request import EngineRequest, FinishReason, Sequence, Status
from services.engine.runner import PLACEHOLDER, ModelRunner
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledChunk, Scheduler
from services.engine.seeds import choice_seed
from services.engine.speculative import Speculator, draft_proposer
from services.engine.structured import Grammars
from services.model.allocator import keep_freed_memory
from services.model.causal_lm import CausalLM, MtpLayer
from services.settings import EngineConfig
from services.tokenizer.detokenize import IncrementalDetokenizer
from services.tokenizer.tokenizer import Tokenizer


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
        self.grammars = Grammars(tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.sampler = Sampler(mc.vocab_size, mc.eos_token_ids, self.grammars)
        self.runner = ModelRunner(model, config, self.sampler)
        self.blocks = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            namespace or self.runner.namespace(),
            config.enable_prefix_caching,
            self.runner.group_pools(),
        )
        self.speculator: Speculator | None = None
        if config.speculative.enabled:
            drafter = draft_proposer(
                config.speculative, draft, model, self.runner.num_blocks, config.block_size
            )
            self.speculator = Speculator(config.speculative, mc.max_model_len, drafter)
        self.scheduler = Scheduler(config, self.blocks, self._admit, self.speculator, self._holds)
        self.kv_connector = kv_connector
        self.reuse = ChunkReuse(config.reuse, model, self.blocks.namespace)
        if config.reuse.kv_reuse == APPROXIMATE and ChunkReuse.refusal(model):
            raise ValueError(f"--kv-reuse approximate: {ChunkReuse.refusal(model)}")
        self.applier = Applier(
            self.scheduler,
            self.blocks,
            self.grammars,
            self._save,
            self._speculation_done,
            mc.eos_token_ids,
            mc.max_model_len,
        )
        self.flight = InFlight(
            self.applier,
            self.blocks,
            self.sampler,
            self.speculator,
            overlap=async_scheduling(config.async_scheduling, model.device),
            on_cpu=model.device.type == "cpu",
        )
        self.times = StepTimes()
        self._arrivals = itertools.count()

    @property
    def requests(self) -> dict[str, LiveRequest]:
        return self.applier.requests

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineRequest, connector: KVConnector | None = None) -> None:
        """Queue a request, or raise ValidationError (nothing queued) if it cannot be run.
        `connector`: the scheduler half of its KV beyond the engine (needs `kv_connector`)."""
        assert connector is None or self.kv_connector is not None, "no worker half to move KV"
        self._validate(request)
        seqs = self._sequences(request)
        if seqs[0].approximate:
            self.reuse.add(request.found_chunks)
        self.requests[request.request_id] = LiveRequest(seqs, seqs[1:], connector)
        # Choices 1..n-1 wait until choice 0 has computed the prompt; they then find its
        # full blocks in the prefix cache and share them instead of computing them again.
        self.scheduler.add(seqs[0])

    def _validate(self, request: EngineRequest) -> None:
        mc, params, prompt = self.model.config, request.params, request.prompt_ids
        params.validate(mc.vocab_size)
        validate_prompt(prompt, mc.vocab_size, mc.max_model_len, params.max_tokens)
        validate_images(request.images, prompt, mc.vision, mc.hidden_size)
        validate_chunks(request.chunks, len(prompt))
        if self.reuse.validate(request.kv_reuse) and ChunkReuse.refusal(self.model):
            raise ValidationError("kv_reuse", ChunkReuse.refusal(self.model))
        if request.request_id in self.requests:
            raise ValidationError("request_id", f"{request.request_id!r} is already running")
        if len(request.output_ids) >= params.max_tokens:
            raise ValidationError("output_token_ids", "already max_tokens long")
        need = -(-(len(prompt) + params.max_tokens) // self.config.block_size)
        if need > self.blocks.num_blocks:
            raise ValidationError(
                "max_tokens",
                f"prompt plus max_tokens needs {need} KV blocks; the pool has "
                f"{self.blocks.num_blocks}",
            )

    def _sequences(self, request: EngineRequest) -> list[Sequence]:
        """The request's n choices, each with the text of its earlier output (not sent again,
        but stop strings see it)."""
        prompt, output, params = request.prompt_ids, request.output_ids, request.params
        grammar = params.grammar
        matcher = None if grammar is None else self.grammars.matcher(grammar, output)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        hashes = request.block_hashes[: len(prompt) // self.config.block_size]
        vision = self.model.config.vision if request.images else None
        approximate = self.reuse.validate(request.kv_reuse) and not request.images
        seqs = []
        for i in range(params.n):
            detokenizer = self._detokenizer(prompt, output, params)
            seq = Sequence(
                request_id=request.request_id,
                index=i,
                prompt_len=len(prompt),
                token_ids=[*prompt, *output],
                params=params,
                seed=choice_seed(seed, i),
                arrival=next(self._arrivals),
                salt=request.salt,
                detokenizer=detokenizer,
                block_hashes=list(hashes),
                images=request.images,
                whole_images=vision is not None and vision.bidirectional,
                matcher=matcher if i == 0 or matcher is None else matcher.deep_copy(),
                approximate=approximate,
                chunks=tuple(request.chunks),
            )
            seq.text = detokenizer.text
            sent = request.text_sent
            seq.emitted_chars = len(seq.text) if sent is None else min(sent, len(seq.text))
            seqs.append(seq)
        return seqs

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
        connector = self.applier.connector(seq)
        prefix = connector.prefix(seq) if connector is not None else None
        if connector is None or prefix is None:
            cached = self.blocks.admit(seq)
        else:
            items = self.blocks.admit_external(
                seq, prefix.hashes, prefix.partial_tokens, prefix.skipped
            )
            if items is None:
                return 0
            if items:
                assert self.kv_connector is not None
                self.kv_connector.load(self.runner.kv, prefix.source, items)
            connector.admitted(self.blocks, seq)
            cached = seq.num_computed_tokens
        if seq.approximate:  # chunks found past the prefix: computed over them, but the last
            self.reuse.admit(seq, self.runner.kv, self.blocks)
        return cached

    def _save(self, seq: Sequence, blocks: list[BlockToSave]) -> None:
        assert self.kv_connector is not None
        self.kv_connector.save(self.runner.kv, seq, blocks)

    def _speculation_done(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.finished(seq)

    def _holds(self, seq: Sequence) -> bool:
        return self.flight.holds(seq)

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
                self.applier.finish(seq)
                seq.finish_reason = FinishReason.ABORT
                deltas.append(SequenceDelta.finished_only(seq))
        return deltas

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def only_awaiting_rows(self) -> bool:
        """Every unfinished request waits for its images' rows: a step has nothing to do."""
        s, flight = self.scheduler, self.flight
        if s.running or flight.sampled is not None or flight.placed or not s.waiting:
            return False
        return all(seq.awaiting_rows for seq in s.waiting)

    def add_rows(self, request_id: str, images: Seq[PromptImage]) -> bool:
        """The rows of a request's images, added without them (PromptImage.embeds None), in
        order: its sequences may enter the batch now. False when the request is gone
        (aborted); ValidationError for rows that do not fit its images."""
        live = self.requests.get(request_id)
        if live is None:
            return False
        mc, first = self.model.config, live.seqs[0]
        if any(i.embeds is None for i in images) or [i.span for i in images] != [
            i.span for i in first.images
        ]:
            raise ValidationError("images", "rows for other images than the request's")
        prompt = first.token_ids[: first.prompt_len]
        validate_images(images, prompt, mc.vision, mc.hidden_size)
        for seq in live.seqs:
            seq.images = tuple(images)
        return True

    # -- the loop --------------------------------------------------------------------

    def step(self) -> list[SequenceDelta]:
        """One forward pass; what sequences gained from the one before it (with async
        scheduling, applied while this one computes) or from this one (synchronous)."""
        t0, start_ns = time.perf_counter(), time.time_ns()
        self.flight.place_early()  # the last step's proposals verified: the next ones need them
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return self.flight.land()
        chunks = scheduled.chunks
        batch = self.runner.prepare(chunks, *self.flight.fed)  # the last step's tokens fed in
        t1 = time.perf_counter()
        logits, deltas, landing = self.flight.while_computing(lambda: self.runner.forward(batch))
        t2 = time.perf_counter()
        timing = StepTiming(start_ns, time.time_ns(), len(chunks), scheduled.num_tokens)
        deltas += self.flight.launch(self._sample(chunks, logits, timing))
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t2, landing)
        return deltas

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, timing: StepTiming
    ) -> Sampled | None:
        """Count the pass's KV, then sample the rows of sequences still going (the last
        step's tokens may have ended some: what they drew is dropped)."""
        if self.speculator is not None:  # an MTP layer drafts from the target's hidden rows
            self.speculator.observe(chunks, self.model)
        for c in chunks:
            c.seq.scheduled_ns = c.seq.scheduled_ns or timing.start_ns
            if not c.seq.is_finished and not c.draft:  # a draft's KV counts once verified
                self.applier.computed(c.seq, c.start + c.num_tokens)
                if c.seq.approximate and c.seq.chunks_kept < len(c.seq.chunks):
                    self.reuse.keep(c.seq, self.runner.kv)
        logits = score_prompts(chunks, logits)
        # one row per sampled token: a chunk's last, or its last and each proposed one's
        rows = [(c, j) for c in chunks if c.want_logits for j in range(len(c.draft) + 1)]
        keep = [i for i, (c, _) in enumerate(rows) if not c.seq.is_finished]
        if not keep:
            return None
        x = logits if len(keep) == len(rows) else logits[keep]
        seqs = [rows[i][0].seq for i in keep]
        ahead = [rows[i][0].draft[: rows[i][1]] for i in keep]  # proposals before the row
        tokens, logprobs = self.runner.sample(x, seqs, ahead)
        sampled = [c for c in chunks if c.want_logits and not c.seq.is_finished]
        drafts = any(c.draft for c in sampled)
        return Sampled(sampled, tokens, logprobs, timing, x if drafts else None)

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
