"""A prefill worker's half of the engine's KV seam (services/engine/kv_connector.py): what a
prompt brings from the store, which of its blocks go to the store and when, and where the
sequence stops.

- In: the longest run of the prompt's full blocks the store holds, short of its last token
  (computed here: its logits give the first token); nothing for a prompt being scored (its
  every logit is needed).
- Out: each block as soon as it is full and computed, while later chunks compute; the
  prompt's partial last block once the prompt is done. The worker answers once every one is
  written (docs/design.md: when prefill replies, every block it names is readable).
- The sequence is handed off at its first token: decode goes on elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvstore.block_hash import ImageSpan
from services.engine.block_manager import BlockManager
from services.engine.kv_connector import BlockToSave, ImportedKV, full_blocks
from services.engine.params import SamplingParams
from services.engine.request import Sequence
from services.worker.kv_link import KVLink


class PrefillConnector:
    def __init__(
        self, block_hashes: list[bytes], partial_hash: bytes | None, imported: ImportedKV | None
    ) -> None:
        self.block_hashes = block_hashes  # the prompt's full blocks'
        self.partial_hash = partial_hash  # its partial last block's, if it has one
        self.imported = imported
        self.sent: dict[int, int] = {}  # choice -> leading full blocks in the store

    @classmethod
    async def fetch(
        cls,
        link: KVLink,
        request_id: str,
        prompt: Seq[int],
        salt: bytes,
        params: SamplingParams,
        images: Seq[ImageSpan] = (),
    ) -> PrefillConnector:
        """The connector of a prompt, with what the store holds of it."""
        full, partial = link.hashes(prompt, salt, images)
        usable = (len(prompt) - 1) // link.layout.block_size  # the last token computes
        if params.prompt_logprobs is not None:
            usable = 0
        imported = await link.fetch(request_id, full[:usable], None, 0) if usable else None
        return cls(full, partial, imported)

    def prefix(self, seq: Sequence) -> ImportedKV | None:
        return self.imported

    def admitted(self, blocks: BlockManager, seq: Sequence) -> None:
        self.sent[seq.index] = seq.num_computed_tokens // blocks.block_size  # stored already
        self.imported = None  # recomputed (or the cache's) if the sequence is preempted

    def computed(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        sent = self.sent.get(seq.index, 0)
        out = full_blocks(blocks, seq, sent)
        sent = self.sent[seq.index] = max([sent] + [b.index + 1 for b in out])
        rest = seq.prompt_len - sent * blocks.block_size
        done = seq.num_computed_tokens >= seq.prompt_len
        exact = seq.approximate_from is None  # approximate KV is never stored (chunk_reuse.py)
        if self.partial_hash is not None and done and exact and 0 < rest < blocks.block_size:
            out.append(BlockToSave(sent, seq.block_ids[sent], self.partial_hash, rest))
            self.partial_hash = None  # sent once
        return out

    def hands_off(self, seq: Sequence) -> bool:
        return True

    def finished(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        return []  # every block went as it was computed
