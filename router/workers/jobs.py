"""What the router hands its pipeline and gets back: a validated request's Job (one prompt, n
choices, its block hashes and images) and the Deltas each choice streams."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.rpc import worker_pb2 as pb


@dataclass(frozen=True)
class Job:
    """A validated request: one prompt, n choices."""

    request_id: str
    prompt_ids: list[int]
    params: pb.SamplingParams
    seed: int
    n: int = 1
    salt: bytes = b""
    index_base: int = 0  # this prompt's first choice index in the response
    # the prompt's block hashes in the workers' namespace (Pipeline.block_hashes), computed
    # once: the router's own account of what each worker caches (routing and backlogs)
    block_hashes: Sequence[bytes] = ()
    # the prompt's images (files checked at the edge), in the order of its image places
    images: Sequence[bytes] = ()
    # KV reuse: "exact", "approximate" or "" (the workers' default), and the prompt's chunks
    # (router/completions/chunks.py) as token spans [start, end)
    kv_reuse: str = ""
    chunks: Sequence[tuple[int, int]] = ()

    @functools.cached_property
    def reuse_chunks(self) -> tuple[tuple[bytes, int], ...]:
        """(digest, tokens) of its chunks where it asks for approximate reuse (the router's
        account of what workers keep: policy.py; the digest is the router's own, of the
        chunk's tokens and the salt)."""
        if self.kv_reuse != "approximate":
            return ()
        ids = self.prompt_ids
        return tuple((chunk_digest(ids[a:b], self.salt), b - a) for a, b in self.chunks)

    @property
    def wire_chunks(self) -> list[pb.Chunk]:
        return [pb.Chunk(start=a, end=b) for a, b in self.chunks]

    @property
    def wire_images(self) -> list[pb.Image]:
        return [pb.Image(data=data) for data in self.images]

    def images_being_encoded(self, wait_ms: int) -> list[pb.Image]:
        """The images as a worker gets them while encoders make their rows: it waits up to
        `wait_ms` for each image's rows in the store before encoding it itself."""
        return [pb.Image(data=data, wait_ms=wait_ms) for data in self.images]


@dataclass
class Delta:
    index: int  # choice index in the response
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0  # on a choice's first delta: prompt tokens not computed
    store_tokens: int = 0  # ... of which read from the KV store (the rest: a worker's cache)
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # tokens 1.., once
    # on a choice's first delta: prompt tokens placed from chunks computed for other prompts
    # (approximate KV reuse), and of them those computed again
    approximate_tokens: int = 0
    recomputed_tokens: int = 0


def chunk_digest(tokens: Sequence[int], salt: bytes) -> bytes:
    return hashlib.sha256(salt + b"\0" + np.asarray(tokens, dtype="<i4").tobytes()).digest()
