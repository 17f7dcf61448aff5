"""A decode worker's side of the engine's KV seam (services/engine/kv_transfer.py).

The prompt's KV comes from the store at admission (what it lacks is computed here); a finished
generation's blocks are written back whole, when `exporter` is given (the write_back setting),
so the next turn of a conversation finds its prompt and the answer in the store. Written at
the end, not as blocks fill: the encoding stays off the path of the stream's tokens.
"""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.kv_transfer import StoreTransfer
from services.engine.request import Sequence


class DecodeTransfer(StoreTransfer):
    def finished(self, blocks: BlockManager, seq: Sequence) -> None:
        self.export(blocks, seq)
