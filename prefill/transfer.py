"""A prefill worker's side of the engine's KV seam (services/engine/kv_transfer.py).

A prompt's blocks go to the store as soon as each is full and computed, while later chunks
compute, and its partial last block when the prompt is done; the sequence finishes at its
first token (FinishReason.PREFILLED), which the worker sends back once every block it names
is written.
"""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.kv_transfer import Exporter, ImportedKV, StoreTransfer
from services.engine.request import Sequence


class PrefillTransfer(StoreTransfer):
    finishes_at_first_token = True

    def __init__(
        self, imported: ImportedKV | None, exporter: Exporter, partial_hash: bytes | None
    ) -> None:
        super().__init__(imported, exporter)
        self.partial_hash = partial_hash  # the prompt's partial last block's, if it has one

    def computed(self, blocks: BlockManager, seq: Sequence) -> None:
        self.export(blocks, seq, self.partial_hash)
