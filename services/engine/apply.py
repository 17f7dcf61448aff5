"""What happens on the host once a sequence has a token, and the table of live requests.

A token goes through two stages (inflight.py decides when each runs):

    placed    written into the sequence, its grammar advanced: the next step's proposals and
              masks see it; `place` says whether it ends the sequence
    applied   its logprobs kept, stop conditions and stop strings checked, its text made and
              streamed as a delta; a finished sequence saves what its connector asks, leaves the
              scheduler and frees its blocks

`computed` is the third thing the host does for a sequence each step: its KV now holds more
tokens, so its full blocks are named, saved where its connector asks, and its groups' parts
out of reach let go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.kv_connector import BlockToSave, KVConnector
from services.engine.outputs import SequenceDelta, StepTiming, StopChecker
from services.engine.request import Sequence, TokenLogprobs
from services.engine.scheduler import Scheduler
from services.engine.structured import Grammars


@dataclass
class LiveRequest:
    seqs: list[Sequence]
    held_back: list[Sequence] = field(default_factory=list)  # choices 1..n-1 before prefill
    connector: KVConnector | None = None  # its KV beyond the engine (kv_connector.py)


class Applier:
    def __init__(
        self,
        scheduler: Scheduler,
        blocks: BlockManager,
        grammars: Grammars,
        save: Callable[[Sequence, list[BlockToSave]], None],
        finished: Callable[[Sequence], None],
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        """`save`: hands blocks to the worker half of the KV seam; `finished`: what else
        ends with a sequence (a speculator's state)."""
        self.scheduler, self.blocks, self.grammars = scheduler, blocks, grammars
        self._save, self._finished = save, finished
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.requests: dict[str, LiveRequest] = {}

    def connector(self, seq: Sequence) -> KVConnector | None:
        req = self.requests.get(seq.request_id)
        return req.connector if req is not None else None

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """seq's KV now holds its first `num_computed` tokens: name its full blocks."""
        seq.num_computed_tokens = num_computed
        self.blocks.commit(seq)
        connector = self.connector(seq)
        if connector is not None:
            self.save(seq, connector.computed(self.blocks, seq))
        self.blocks.slide(seq)

    def place(self, seq: Sequence, token: int) -> bool:
        """Write `token` in as seq's next; whether it ends the sequence, text aside."""
        seq.token_ids.append(token)
        if seq.matcher is not None:
            self.grammars.advance(seq.matcher, token)
        return self.stops(seq).token_reason(token, self.hands_off(seq)) is not None

    def apply(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, step: StepTiming
    ) -> SequenceDelta:
        """The effects of seq's last token, `token` (placed): stops, text, the delta."""
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        connector = self.connector(seq)
        delta = self.stops(seq).apply(token, step, self.hands_off(seq))
        if seq.finish_reason is not None:
            if connector is not None:  # before its blocks are released
                self.save(seq, connector.finished(self.blocks, seq))
            self.finish(seq)
        if seq.index == 0 and seq.num_output_tokens == 1:
            self._release_held_back(seq.request_id)
        req = self.requests.get(seq.request_id)
        if req is not None and all(s.is_finished for s in req.seqs):
            del self.requests[seq.request_id]
        return delta

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._finished(seq)

    def stops(self, seq: Sequence) -> StopChecker:
        return StopChecker(seq, self.eos_token_ids, self.max_model_len)

    def hands_off(self, seq: Sequence) -> bool:
        connector = self.connector(seq)
        return connector is not None and connector.hands_off(seq)

    def save(self, seq: Sequence, blocks: list[BlockToSave]) -> None:
        if blocks:
            self._save(seq, blocks)

    def _release_held_back(self, request_id: str) -> None:
        """Choices 1..n-1 start once choice 0 has its first token: they find its prompt's
        blocks in the prefix cache."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.held_back:
            self.scheduler.add(seq)
        req.held_back = []
