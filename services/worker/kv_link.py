"""A worker's one link to the KV store: the store, its codec and the worker's KV layout, and
what a worker does with them: hashing a prompt's blocks (once per request), fetching the
blocks the engine's cache lacks, and, as the worker half of the engine's KV seam
(services/engine/kv_connector.py), loading fetched blocks into the cache and saving the
blocks the requests' connectors hand out, then waiting for their writes.

The worker owns it. Everything runs on the worker's event loop except `load` and `save`,
which the engine thread calls: `save` right after the step that computed the blocks (or when
the sequence finishes), copying and encoding them there (before they can change hands) and
leaving the write to the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Container
from collections.abc import Sequence as Seq

from kvstore import open_store
from kvstore.block_hash import ImageSpan, KVLayout, block_hashes
from kvstore.blocks import BlockStore, StoredBlocks
from kvstore.codec import BlockCodec, StorageDtype
from kvstore.keyfile import read_key
from kvstore.store import KVStore, StoreUnavailable, Value
from services.engine.kv_connector import BlockToSave, ImportedKV, KVSource
from services.engine.request import Sequence
from services.model.kv_cache import KVCache
from services.settings import StoreSettings
from services.worker.fetch_choice import Choice

log = logging.getLogger("pdserve.worker")
FETCH_BATCH = 8  # blocks per store read while fetching a prompt gently (see fetch)
FETCH_PAUSE = 0.005  # seconds between those reads
READS_IN_FLIGHT = 2  # reads at a time (one on the wire while another's bytes are checked)
# seconds the link reads nothing after the store failed a read: a store that is down (or a
# blackholed link, each read waiting store_timeout) costs the requests meanwhile nothing
STORE_RETRY = 2.0


class KVLink:
    def __init__(
        self,
        layout: KVLayout,
        storage: StorageDtype,
        settings: StoreSettings,
        *,
        cached_hashes: Callable[[], Container[bytes]],
        attention_k: float,
    ) -> None:
        """`cached_hashes`: a snapshot of the blocks the engine's prefix cache holds;
        `attention_k`: the model's (services/worker/fetch_choice.py)."""
        self.layout = layout
        self.namespace = layout.namespace()
        key = read_key(settings.kv_key_file) if settings.kv_key_file else None
        self.codec = BlockCodec(layout, storage, key)
        if key is None:
            log.warning(
                "no kv_key_file: stored blocks are checksummed, not authenticated "
                "(whoever can write to the store can plant KV)"
            )
        self.store: KVStore = open_store(
            settings.kv_store,
            self.namespace,
            timeout=settings.store_timeout,
            max_bytes=settings.max_bytes,
        )
        self.blocks = BlockStore(self.store, self.codec)
        self.cached_hashes = cached_hashes
        self.store_failures = 0  # requests that went on without the store
        self.pending_puts: dict[str, list[concurrent.futures.Future[None]]] = defaultdict(list)
        self.writing: set[concurrent.futures.Future[None]] = set()  # every write not done
        self._writes = asyncio.Lock()  # one write call on the link at a time
        self._reads = asyncio.Semaphore(READS_IN_FLIGHT)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down_until = 0.0  # time.monotonic() before which no read is tried
        # what to read and what to compute, from the measured link and prompt rate
        self.choice = Choice(
            settings.kv_fetch, attention_k, layout.block_size, FETCH_BATCH, FETCH_PAUSE
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that writes exported blocks."""
        self._loop = loop

    async def probe(self) -> bool:
        """Whether the store answers (a read of a key no block has): a worker starting with
        a store it cannot reach says so, and computes prompts until the store answers."""
        try:
            start = time.perf_counter()
            await self.store.get_many([bytes(16)])
            self.choice.observe_read(0, 0, time.perf_counter() - start)  # a round trip
        except StoreUnavailable as e:
            log.warning(
                "kv store unreachable: computing prompts until it answers",
                extra={"fields": {"why": str(e)}},
            )
            self._down_until = time.monotonic() + STORE_RETRY
            return False
        return True

    # -- a request's blocks ---------------------------------------------------------

    def hashes(
        self, prompt: Seq[int], salt: bytes, images: Seq[ImageSpan] = ()
    ) -> tuple[list[bytes], bytes | None]:
        """The prompt's full-block hashes, and its partial block's (None if it has none)."""
        bs = self.layout.block_size
        hashes = block_hashes(prompt, bs, self.namespace, salt, True, images)
        if len(prompt) % bs:
            return hashes[:-1], hashes[-1]
        return hashes, None

    # -- KV in ------------------------------------------------------------------------

    async def fetch(
        self,
        request_id: str,
        full: list[bytes],
        partial: bytes | None,
        partial_tokens: int,
        gentle: bool = False,
        prefetched: list[bytes] | None = None,
        compute_head: Callable[[int], Awaitable[None]] | None = None,
    ) -> ImportedKV | None:
        """The longest valid run of these blocks in the store (and the partial block after
        them if all are there); None if none, or if the store is unavailable.

        `gentle` (decode: streams are running) reads FETCH_BATCH blocks at a time with a
        pause between reads: each read and decode then holds the GIL and the cores for a few
        milliseconds only, and the engine thread stepping the running batch meanwhile is
        never kept waiting long (one 46 MB read stalled a step by ~170 ms).

        Leading blocks the engine's cache holds are not read (what KV-aware routing buys):
        the import names them and the engine shares them at admission.

        `prefetched`: the leading blocks read already (decode/prefetch.py; b"" for those the
        cache held then): the rest is read, whatever the choice (the prefetch made it).

        `compute_head(n)`: has the engine compute the prompt's first n blocks (into its
        prefix cache); given, the choice may split: a head computed while the rest is read,
        then imported as blocks the cache holds."""
        start = time.perf_counter()
        if time.monotonic() < self._down_until:  # failed a moment ago: not asked again yet
            self.store_failures += 1
            return None
        cached = self.cached_hashes()  # a snapshot: the engine thread owns the cache
        skipped = next((i for i, h in enumerate(full) if h not in cached), len(full))
        plan = self.choice.plan(skipped, len(full) - skipped, compute_head is not None)
        head = skipped + plan.head  # computed here meanwhile (a split), held by the cache
        wanted = head + plan.blocks  # the rest computed (read no faster, or never)
        values: list[bytes] = [b""] * head
        if prefetched is not None:
            skipped = next((i for i, v in enumerate(prefetched) if v), len(prefetched))
            values, wanted = prefetched, len(full)
        try:
            split = head > skipped and compute_head is not None and prefetched is None
            if split and not await self.store.longest_prefix([full[wanted - 1]]):
                values, head, split = values[:skipped], skipped, False  # no tail stored
            if split and compute_head is not None:
                began = time.perf_counter()
                tail, _ = await asyncio.gather(  # the head computed even if the read fails
                    self.read_run(full[head:wanted], gentle),
                    compute_head(head),
                    return_exceptions=True,
                )
                if isinstance(tail, BaseException):
                    raise tail
                if plan.split_s and len(tail) == wanted - head:  # whole: a fair sample
                    self.choice.observe_split(plan.split_s, time.perf_counter() - began)
                values, skipped = values + tail, head
            else:
                values += await self.read_run(full[len(values) : wanted], gentle)
            count = len(values)
            if partial is not None and count == len(full):
                values += await self.read_run([partial], gentle)
        except StoreUnavailable as e:
            self.store_failures += 1
            self._down_until = time.monotonic() + STORE_RETRY
            log.warning(
                "store unavailable, computing instead",
                extra={"fields": {"request_id": request_id, "why": str(e)}},
            )
            return None
        has_tail = len(values) > count
        log.info(
            "fetched",
            extra={
                "fields": {
                    "request_id": request_id,
                    "blocks": len(values) - skipped,
                    "cached": skipped,
                    "of": len(full) + (partial is not None),
                    "ms": 1000 * (time.perf_counter() - start),
                    "choice": "prefetched" if prefetched is not None else plan.why,
                    "expected_fetch_ms": _ms(plan.fetch_s),
                    "expected_compute_ms": _ms(plan.compute_s),
                    "head": plan.head,
                    "expected_split_ms": _ms(plan.split_s),
                }
            },
        )
        if not values:
            return None
        source = StoredBlocks(self.codec, values)
        bs = self.layout.block_size
        return ImportedKV(full[:count], source, bs, partial_tokens if has_tail else 0, skipped)

    async def read_run(self, hashes: list[bytes], gentle: bool) -> list[bytes]:
        """The leading run of these blocks the store holds (valid ones). Gently: FETCH_BATCH
        blocks per read (fewer on a slow link: Choice.read_blocks), READS_IN_FLIGHT reads at
        a time (one on the wire while another's
        bytes are checked: the link stays busy) and a pause after each; else in one read.
        Each read measures the link: its bytes over the time since the read before it
        ended (or since it began, if later)."""
        step = self.choice.read_blocks() if gentle else max(1, len(hashes))
        batches = [hashes[i : i + step] for i in range(0, len(hashes), step)]
        # one read at a time until the link is measured (or after a read failed): two of
        # unknown size at once may both wait on a slow link past store_timeout
        measured = self.choice.link.bytes_per_s and not self.choice.cautious
        in_flight = READS_IN_FLIGHT if gentle and measured else 1
        values: list[bytes] = []
        waiting: deque[tuple[asyncio.Task[list[bytes]], int, float]] = deque()
        last = 0.0
        try:
            while batches or waiting:
                while batches and len(waiting) < in_flight:
                    batch = batches.pop(0)
                    task = asyncio.create_task(self._get(batch))
                    waiting.append((task, len(batch), time.perf_counter()))
                task, wanted, began = waiting.popleft()
                try:
                    got = await task
                except StoreUnavailable:  # down, or slower than measured: small reads next
                    self.choice.cautious = True
                    raise
                done = time.perf_counter()
                self.choice.observe_read(sum(map(len, got)), len(got), done - max(began, last))
                last = done
                values += got
                if len(got) < wanted:
                    break
                if gentle:
                    await asyncio.sleep(FETCH_PAUSE)  # leave the cores to the batch a moment
        finally:
            for task, _, _ in waiting:
                task.cancel()
            await asyncio.gather(*(t for t, _, _ in waiting), return_exceptions=True)
        return values

    async def _get(self, hashes: list[bytes]) -> list[bytes]:
        async with self._reads:  # READS_IN_FLIGHT on the link, whatever the requests
            return [value for value, _ in await self.blocks.get_checked(hashes)]

    # -- KV out -------------------------------------------------------------------------

    def load(self, cache: KVCache, source: KVSource, items: list[tuple[int, int]]) -> None:
        """Fetched blocks into the cache (the engine thread, at admission)."""
        source.write(cache, items)

    def save(self, cache: KVCache, seq: Sequence, ready: list[BlockToSave]) -> None:
        """Blocks a connector hands out (the engine thread): copied and encoded now, written by
        the event loop."""
        assert self._loop is not None
        k, v = cache.gather([b.block_id for b in ready])
        items = self.blocks.encode(
            k, v, [b.block_hash for b in ready], [b.num_tokens for b in ready]
        )
        future = asyncio.run_coroutine_threadsafe(self._put(items), self._loop)
        self.pending_puts[seq.request_id].append(future)
        self.writing.add(future)
        future.add_done_callback(self.writing.discard)  # on the event loop's thread

    async def _put(self, items: list[tuple[bytes, Value]]) -> None:
        """Written FETCH_BATCH blocks per call, one call at a time on the link: each call's
        store_timeout covers a few MB of its own, not a long prompt's whole KV (8000 tokens,
        184 MB, timed out on any link) nor the calls queued before it on a slow link (a
        prefill's writes on 0.1 Gbit/s did, and the prefill failed)."""
        for i in range(0, len(items), FETCH_BATCH):
            async with self._writes:
                await self.store.put_many(items[i : i + FETCH_BATCH])

    async def wait_for_puts(self, request_id: str) -> None:
        """Until every block saved for the request is written (StoreUnavailable if not)."""
        for future in self.pending_puts.pop(request_id, []):
            await asyncio.wrap_future(future)

    async def flush(self, timeout: float) -> None:
        """Until every write begun is done (at most `timeout` seconds): a worker stopping
        leaves the blocks it computed in the store. Called once the engine thread, which
        begins writes, has stopped."""
        if self.writing:
            futures = [asyncio.wrap_future(f) for f in list(self.writing)]
            await asyncio.wait(futures, timeout=timeout)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request's writes (they finish on their own)."""
        self.pending_puts.pop(request_id, None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)
