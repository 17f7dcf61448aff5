"""Requests and their sequences: one sequence per choice (n), each with its own status.

    token_ids:  | prompt ................ | output ........ |
                |<-- num_computed_tokens -->|             |   KV in the cache
                                            |<- to compute ->|

A sequence's KV covers its first `num_computed_tokens` tokens; the scheduler hands out the
rest in chunks. The last sampled token is never computed until the next step, so a decoding
sequence always has exactly one token to compute.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as SeqOf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.block_hash import ImageSpan
from services.engine.images import PromptImage, fit_chunk
from services.engine.params import SamplingParams
from services.tokenizer.detokenize import IncrementalDetokenizer

if TYPE_CHECKING:  # (the router imports this module and never torch)
    from kvstore.chunks import StoredChunk


class Status(enum.Enum):
    WAITING = "waiting"  # queued, never run
    RUNNING = "running"
    PREEMPTED = "preempted"  # its blocks were taken back; it is recomputed when rescheduled
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context window
    ABORT = "abort"
    # stopped here unfinished: its KV connector hands the generation on elsewhere (its text
    # is held back as if it went on: services/engine/kv_connector.py)
    HANDED_OFF = "handed_off"


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens, best first
    rank: int = 0  # token_id's rank, 1 = the most likely (prompt scoring); 0: not computed


@dataclass(frozen=True)
class EngineRequest:
    """A request as the engine takes it (Engine.add_request, AsyncEngine.submit).

    Generation elsewhere: `output_ids` are tokens already generated elsewhere (their KV is
    computed here), of whose text `text_sent` characters reached the client (None: all).
    `block_hashes`: the prompt's full-block hashes where the caller has computed them (in the
    engine's namespace, with `salt`), so they are computed once per request in a process;
    else the engine computes them. KV beyond the engine comes with the request's connector
    (Engine.add_request). `images`: the prompt's images (services/engine/images.py), in
    order; their digests are part of `block_hashes`."""

    request_id: str
    prompt_ids: SeqOf[int]
    params: SamplingParams
    salt: bytes = b""  # per-tenant prefix-cache isolation
    output_ids: SeqOf[int] = ()
    text_sent: int | None = None
    block_hashes: SeqOf[bytes] = ()
    images: tuple[PromptImage, ...] = ()
    # approximate KV reuse (services/engine/chunk_reuse.py): "exact" or "approximate" (None:
    # the engine's --kv-reuse), and the chunks of the prompt it may reuse: [start, end) each
    kv_reuse: str | None = None
    chunks: tuple[tuple[int, int], ...] = ()
    # chunks' K/V the worker read from the store for it (by chunk key): into the chunk cache
    found_chunks: tuple[tuple[bytes, StoredChunk], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One choice of a request. Owned by the engine; the scheduler moves it between queues."""

    request_id: str
    index: int  # which of the request's n choices
    prompt_len: int
    token_ids: list[int]  # prompt, then output
    params: SamplingParams
    seed: int  # this choice's seed: the request's, mixed with `index`
    arrival: int  # order of arrival; preemption takes the newest first
    salt: bytes = b""  # per-tenant prefix-cache isolation
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    # per pool of a cache group released early: the first of its blocks holding a part
    # (group_pool.py)
    pool_marks: dict[str, int] = field(default_factory=dict)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, grown lazily
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # output text (stop string removed at the end)
    emitted_chars: int = 0  # how much of `text` has been handed out in deltas
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of tokens 1.. (scoring)
    times_preempted: int = 0
    scheduled_ns: int = 0  # wall clock when it first entered a step (tracing)
    num_external_tokens: int = 0  # prompt tokens its KV connector brought (not the cache's)
    # structured output: its grammar's matcher (services/engine/structured.py), advanced over
    # every output token; None: unconstrained
    matcher: Any = None
    # speculative decoding (services/engine/speculative.py): the n-gram index of its own
    # tokens, and how many tokens it proposes next (0: the configured number)
    spec_index: Any = None
    spec_length: int = 0
    spec_pause: int = 0  # steps left without proposals (they kept failing)
    draft_probs: Any = None  # a draft model's distributions for this step's draft [k, V]
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order
    # an image's rows attend to one another both ways (the model's): a chunk never ends
    # inside an image
    whole_images: bool = False
    # approximate KV reuse (services/engine/chunk_reuse.py): whether it may reuse and keep
    # chunks, the prompt's marked chunks [start, end), how many of them were looked at for
    # keeping, and those placed from the chunk cache
    approximate: bool = False
    chunks: tuple[tuple[int, int], ...] = ()
    chunks_kept: int = 0
    placed_chunks: set[tuple[int, int]] = field(default_factory=set)
    # where its KV stops being exact (the first placed chunk): blocks from there on are never
    # named in the prefix cache; None: all exact
    approximate_from: int | None = None
    num_reused_tokens: int = 0  # prompt tokens whose KV was placed from the chunk cache
    num_recomputed_tokens: int = 0  # ... of which computed again from the check layer on

    @property
    def image_spans(self) -> tuple[ImageSpan, ...]:
        return tuple(i.span for i in self.images)

    @property
    def awaiting_rows(self) -> bool:
        """An image of its prompt has no rows yet (they come with Engine.add_rows)."""
        return any(i.embeds is None for i in self.images)

    def fit_chunk(self, n: int) -> int:
        """The next chunk's size given n: an image never split where it must not be."""
        if not self.whole_images:
            return n
        return fit_chunk(self.images, self.num_computed_tokens, n)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is missing from the cache."""
        return self.num_uncomputed > 1 or self.num_output_tokens == 0
