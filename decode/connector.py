"""A decode worker's half of the engine's KV seam (services/engine/kv_connector.py): what a
request brings from the store and what goes back.

- In: the prompt's blocks from the store, full ones and the partial last one, read gently
  while the running batch keeps stepping (KVLink.fetch); what the store lacks, or refuses, is
  computed here. With local prefill (no prefill worker ran: a colocated stack, a short
  prompt, a prefill backlog) the same: the store is the KV tier in every topology, so a
  conversation's next turn on another worker, or a restarted one, reads what was computed.
- Out (with write_back): a finished generation's full blocks, prompt and answer, that are not
  in the store already, so the next turn of a conversation finds both there. Written at the
  end, not as blocks fill: the encoding stays off the path of the stream's tokens. A model
  whose blocks let go of a part early (a cache group read while recent) is the exception: a
  block goes as it fills, while it is whole (a store value is a whole block).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as Seq

from decode.prefetch import Prefetcher
from kvstore.block_hash import ImageSpan
from services.engine.block_manager import BlockManager
from services.engine.kv_connector import BlockToSave, ImportedKV, full_blocks
from services.engine.request import Sequence
from services.worker.kv_link import KVLink


class DecodeConnector:
    def __init__(
        self, block_hashes: list[bytes], imported: ImportedKV | None, write_back: bool
    ) -> None:
        self.block_hashes = block_hashes  # the prompt's full blocks'
        self.imported = imported
        self.write_back = write_back
        self.in_store: dict[int, int] = {}  # choice -> leading full blocks the store holds

    @classmethod
    async def fetch(
        cls,
        link: KVLink,
        request_id: str,
        prompt: Seq[int],
        salt: bytes,
        write_back: bool,
        prefetcher: Prefetcher | None = None,
        compute_head: Callable[[list[bytes], int], Awaitable[None]] | None = None,
        images: Seq[ImageSpan] = (),
    ) -> DecodeConnector:
        """The connector of a request, with what the store holds of its prompt (and what a
        prefetch read of it already). `compute_head(hashes, n)`: the engine computes the
        prompt's first n blocks, for a split between computing and reading (KVLink.fetch)."""
        full, partial = link.hashes(prompt, salt, images)
        rest = len(prompt) % link.layout.block_size
        read = await prefetcher.claim(request_id, full) if prefetcher is not None else None
        head = None if compute_head is None else functools.partial(compute_head, full)
        imported = await link.fetch(
            request_id, full, partial, rest, gentle=True, prefetched=read, compute_head=head
        )
        return cls(full, imported, write_back)

    def prefix(self, seq: Sequence) -> ImportedKV | None:
        return self.imported

    def admitted(self, blocks: BlockManager, seq: Sequence) -> None:
        self.in_store[seq.index] = seq.num_computed_tokens // blocks.block_size
        self.imported = None  # recomputed (or the cache's) if the sequence is preempted

    def computed(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        if not self.write_back or blocks.keeps_blocks_whole:
            return []
        # blocks that let go of a part early: each block as it fills, while it is whole
        start = self.in_store.get(seq.index, 0)
        out = full_blocks(blocks, seq, start)
        self.in_store[seq.index] = max([start] + [b.index + 1 for b in out])
        return out

    def hands_off(self, seq: Sequence) -> bool:
        return False

    def finished(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        if not self.write_back:
            return []
        return full_blocks(blocks, seq, self.in_store.get(seq.index, 0))
