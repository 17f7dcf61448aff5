"""Approximate KV reuse: a chunk's K/V reused away from the prefix it was computed after.

A request marks chunks of its prompt (chat messages, tool results, documents:
`EngineRequest.chunks`). Where the request's KV reuse is approximate, each marked chunk of at
least `--kv-reuse-min-tokens` tokens, once computed, is kept at every layer under a key of its
own tokens (with the engine's namespace and the request's salt, not what came before it:
`chunk_key`). A later approximate prompt holding a marked chunk past its cached prefix finds
it under that key wherever it now stands:

    prompt:  | exact prefix (cache) | text | chunk A (placed) | text | chunk B (placed) | q |
             |<- num_computed ----->|<---------- computed by blend (below) --------->| 1 |

the chunks' K/V are written into the sequence's slots, keys turned from the positions they
were computed at to the new ones (rotary angles add); the rest up to the last token is
computed CacheBlend's way (services/model/blend.py): every row at layer 0, and from layer
`check_layer` on the rows not placed, each chunk's first and the `--kv-reuse-ratio` of its
tokens whose values deviate most from the placed ones. The last token is then computed as
usual by the next step (its logits are the first token's). bench/kv_blend.py is the dense
reference this equals (tests/services/engine/test_chunk_reuse.py).

What stays exact: the blocks before the first placed chunk are the prefix cache's; those from
it on hold approximate K/V and are never named in the prefix cache nor exported
(`Sequence.approximate_from`), so no exact request finds them. Every other sequence of a batch
is computed as it would be alone (its rows never see an approximate one's).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvstore.chunks import StoredChunk
from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.params import ValidationError
from services.engine.request import Sequence
from services.model import kv_cache
from services.model.batch import SeqChunk
from services.model.causal_lm import Blends, CausalLM
from services.model.kv_cache import KVCache
from services.model.layers.rope import turn
from services.settings import ReuseConfig

APPROXIMATE = "approximate"
EXACT = "exact"


def chunk_key(tokens: list[int], namespace: str, salt: bytes) -> bytes:
    """A chunk's name: its tokens alone (with the layout's namespace and the tenant's salt)."""
    h = hashlib.sha256(b"pdserve-chunk\0" + namespace.encode() + b"\0")
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


class ChunkCache:
    """Chunks' K/V by key, the least recently used dropped past `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, StoredChunk] = OrderedDict()
        self.nbytes = 0

    def get(self, key: bytes) -> StoredChunk | None:
        kv = self.entries.get(key)
        if kv is not None:
            self.entries.move_to_end(key)
        return kv

    def put(self, key: bytes, kv: StoredChunk) -> None:
        if key in self.entries or kv.nbytes > self.capacity:
            return
        self.entries[key] = kv
        self.nbytes += kv.nbytes
        while self.nbytes > self.capacity:
            _, dropped = self.entries.popitem(last=False)
            self.nbytes -= dropped.nbytes


@dataclass(frozen=True)
class Placed:
    """A cached chunk standing at `start` of a prompt."""

    start: int
    kv: StoredChunk

    @property
    def end(self) -> int:
        return self.start + int(self.kv.keys.shape[1])


class ChunkReuse:
    """The engine's approximate reuse: what it keeps of computed chunks, and how a prompt is
    computed over the ones it finds. Owned by the engine; runs on its thread."""

    def __init__(self, config: ReuseConfig, model: CausalLM, namespace: str) -> None:
        self.config, self.namespace = config, namespace
        self.model = model
        self.cache = ChunkCache(int(config.cache_gb * 2**30))
        # where a cached key's rotary part starts, and its frequencies (a model that blends)
        self.rotation = (
            cast(Blends, model).key_rotation() if model.capabilities.approximate_reuse else None
        )
        self.reused = self.recomputed = 0  # tokens, since start
        # told of each chunk kept, on the engine's thread (a worker stores it for the others:
        # services/worker/chunk_link.py); its tensors are copies, never the cache's
        self.sink: Callable[[bytes, StoredChunk], None] | None = None

    def add(self, found: tuple[tuple[bytes, StoredChunk], ...]) -> None:
        """Chunks read from outside (the store) for a request, into the chunk cache."""
        for key, kv in found:
            self.cache.put(key, kv)

    @staticmethod
    def refusal(model: CausalLM) -> str:
        """Why the model cannot reuse K/V approximately ("" where it can): docs/design.md."""
        if model.capabilities.approximate_reuse:
            return ""
        c = model.config
        if c.architecture.startswith("deepseek_v4"):
            why = (
                "its compressed entries each stand for a run of neighbouring tokens, which a "
                "moved chunk no longer has around it, and cannot be recomputed token by token"
            )
        elif c.architecture.startswith("deepseek_v32"):
            why = "its indexer's keys would need the same repair as the latents: not built"
        elif c.sliding_window is not None or c.vision is not None:
            why = "it is built for attention over the whole context, text-only prompts"
        else:
            why = "it is built for one rank and rotary attention over every position"
        return f"approximate KV reuse is not available for {c.architecture}: {why} (docs/design.md)"

    def validate(self, kv_reuse: str | None) -> bool:
        """Whether a request asking for `kv_reuse` (None: the default) reuses approximately;
        ValidationError where it may not."""
        if kv_reuse not in (None, EXACT, APPROXIMATE):
            raise ValidationError("kv_reuse", f"{kv_reuse!r} is not exact or approximate")
        default = self.config.kv_reuse
        if kv_reuse not in (None, default) and not self.config.requests:
            raise ValidationError(
                "kv_reuse", f"this server's KV reuse is {default}; requests may not choose"
            )
        return (kv_reuse or default) == APPROXIMATE

    # -- keeping chunks ------------------------------------------------------------------

    def keep(self, seq: Sequence, kv: KVCache) -> None:
        """Keep seq's marked chunks computed since the last call (none it reused), telling the
        sink of each."""
        placed = seq.placed_chunks
        while seq.chunks_kept < len(seq.chunks):
            start, end = seq.chunks[seq.chunks_kept]
            if end > seq.num_computed_tokens:
                return
            seq.chunks_kept += 1
            if end - start < self.config.min_tokens or (start, end) in placed:
                continue
            key = chunk_key(seq.token_ids[start:end], self.namespace, seq.salt)
            if key not in self.cache.entries:
                chunk = self._read(seq, kv, start, end)
                self.cache.put(key, chunk)
                if self.sink is not None:
                    self.sink(key, chunk)

    def wanted(
        self, prompt_len: int, chunks: tuple[tuple[int, int], ...], past: int
    ) -> list[tuple[int, int]]:
        """The chunks `find` would look for in a prompt whose first `past` tokens are had
        otherwise: [start, end) each."""
        return [
            (start, end)
            for start, end in chunks
            if start >= past and end < prompt_len and end - start >= self.config.min_tokens
        ]

    def _read(self, seq: Sequence, kv: KVCache, start: int, end: int) -> StoredChunk:
        slots = _slots(seq, start, end, kv.block_size, kv.device)
        rows = [kv_cache.read(*kv.layer(i), slots) for i in range(self.model.config.num_layers)]
        keys = torch.stack([k for k, _ in rows])
        return StoredChunk(start, keys, torch.stack([v for _, v in rows]))

    # -- reusing them --------------------------------------------------------------------

    def find(self, seq: Sequence) -> list[Placed]:
        """The cached chunks of seq's prompt past its computed prefix and before its last
        token (whose logits are asked for)."""
        found = []
        for start, end in self.wanted(seq.prompt_len, seq.chunks, seq.num_computed_tokens):
            cached = self.cache.get(chunk_key(seq.token_ids[start:end], self.namespace, seq.salt))
            if cached is not None:
                found.append(Placed(start, cached))
        return found

    def admit(self, seq: Sequence, kv: KVCache, blocks: BlockManager) -> None:
        """Compute seq's prompt up to its last token over the chunks found (if any) in its
        blocks; nothing changes where none is found or the pool is short (computed exactly)."""
        seq.approximate_from, seq.placed_chunks = None, set()  # (an earlier admission's)
        seq.num_reused_tokens = seq.num_recomputed_tokens = 0
        placed = self.find(seq)
        if not placed:
            return
        start, end = seq.num_computed_tokens, seq.prompt_len - 1
        try:
            blocks.allocate(seq, end - start)
        except NoFreeBlocks:
            return  # computed exactly, as if nothing were found
        for p in placed:
            self._place(seq, kv, p)
        chunk = SeqChunk(
            seq.token_ids[start:end],
            start,
            seq.block_ids,
            want_logits=False,
            tables=kv.tables(seq.block_ids),
        )
        reused = torch.zeros(end - start, dtype=torch.bool)
        for p in placed:
            reused[p.start - start : p.end - start] = True
        firsts = [p.start - start for p in placed]

        def choose(new_v: torch.Tensor, old_v: torch.Tensor) -> list[int]:
            return choose_rows(new_v, old_v, reused, firsts, self.config.ratio)

        model = cast(Blends, self.model)
        rows, _ = model.blend(chunk, kv, choose, self.config.check_layer)
        seq.num_computed_tokens = end
        seq.approximate_from = placed[0].start
        seq.placed_chunks = {(p.start, p.end) for p in placed}
        seq.num_reused_tokens = int(reused.sum())
        seq.num_recomputed_tokens = int(reused[rows].sum())
        self.reused += seq.num_reused_tokens
        self.recomputed += seq.num_recomputed_tokens

    def _place(self, seq: Sequence, kv: KVCache, p: Placed) -> None:
        """Write a found chunk's K/V into seq's slots at its new positions, keys' rotary
        part turned (services/model: `key_rotation`)."""
        assert self.rotation is not None
        start, inv_freq = self.rotation
        slots = _slots(seq, p.start, p.end, kv.block_size, kv.device)
        keys = p.kv.keys  # [layers, n, heads, D]: every layer turned at once
        if p.start != p.kv.was:
            by = torch.full((len(slots),), p.start - p.kv.was, device=kv.device)
            keys = keys.clone()
            keys[..., start:] = turn(keys[..., start:], by, inv_freq.to(keys.device))
        for i in range(self.model.config.num_layers):
            kv_cache.write(*kv.layer(i), slots, keys[i], p.kv.values[i])


def validate_chunks(chunks: tuple[tuple[int, int], ...], prompt_len: int) -> None:
    """Chunks must be in order, apart, within the prompt and not empty."""
    end = 0
    for start, stop in chunks:
        if not end <= start < stop <= prompt_len:
            raise ValidationError(
                "chunks", f"[{start}, {stop}) is not a span of the prompt after the one before"
            )
        end = stop


def choose_rows(
    new_v: torch.Tensor,
    old_v: torch.Tensor,
    reused: torch.Tensor,
    firsts: list[int],
    ratio: float,
) -> list[int]:
    """CacheBlend's choice (bench/kv_blend.py `Dense._choose`): every row not reused, each
    chunk's first, and `ratio` of the reused ones whose values deviate most (sum of squares
    over heads and dimensions), as sorted rows."""
    deviation = (new_v.float() - old_v.float()).pow(2).flatten(1).sum(1).cpu()
    deviation[~reused] = float("inf")
    deviation[firsts] = float("inf")
    count = int((~reused).sum()) + len(firsts) + round(ratio * int(reused.sum()))
    count = min(count, len(reused))
    return sorted(deviation.topk(count).indices.tolist())


def _slots(seq: Sequence, start: int, end: int, block_size: int, device: torch.device):
    positions = range(start, end)
    slots = [seq.block_ids[p // block_size] * block_size + p % block_size for p in positions]
    return torch.tensor(slots, dtype=torch.int64, device=device)
