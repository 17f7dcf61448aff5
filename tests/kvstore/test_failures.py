"""A dead, unreachable or silent store never hangs a call: StoreUnavailable within the
timeout (plus 0.5 s), and the next call after a restart succeeds."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from kvstore import open_store
from kvstore.store import StoreUnavailable
from tests.support.redis_servers import RedisServer, free_port

TIMEOUT = 1.0
NS = "0" * 32
BLOCK = 368_640  # a bf16 block of SmolLM2


def test_killing_redis_mid_batch_then_restarting(tmp_path):
    server = RedisServer(tmp_path).start()
    items = [(i.to_bytes(32, "little"), os.urandom(BLOCK)) for i in range(64)]

    async def scenario():
        store = open_store(server.url, NS, timeout=TIMEOUT)
        await store.put_many(items[:2])  # connected and working
        killed_at: list[float] = []

        def kill_soon():
            time.sleep(0.02)
            # the time the signal is sent: the store may notice before kill() has reaped
            killed_at.append(time.monotonic())
            server.kill()

        killer = threading.Thread(target=kill_soon)
        killer.start()
        with pytest.raises(StoreUnavailable):
            for _ in range(50):  # big batches until the kill lands in one of them
                await store.put_many(items)
        failed_at = time.monotonic()
        killer.join()
        assert killed_at and failed_at - killed_at[0] <= TIMEOUT + 0.5
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get_many([items[0][0]])
        assert time.monotonic() - start <= TIMEOUT + 0.5

        server.start()  # same port, empty (nothing persisted)
        await store.put_many(items[:1])
        assert await store.get_many([items[0][0]]) == [items[0][1]]
        assert store.stats().unavailable >= 2
        await store.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_nothing_listening():
    port = free_port()

    async def scenario():
        store = open_store(f"redis://127.0.0.1:{port}/0", NS, timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.longest_prefix([b"x" * 32])
        assert time.monotonic() - start <= TIMEOUT + 0.5
        await store.close()

    asyncio.run(scenario())


def test_a_server_that_never_answers():
    """Accepts the connection, reads, says nothing: the timeout is the only way out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                held.append(conn)
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()

    async def scenario():
        store = open_store(f"redis://127.0.0.1:{port}/0", NS, timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get_many([b"y" * 32])
        assert TIMEOUT - 0.1 <= time.monotonic() - start <= TIMEOUT + 0.5
        await store.close()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def test_unknown_url_is_refused():
    with pytest.raises(ValueError, match="unknown KV store URL"):
        open_store("mongodb://x", NS)


def test_missing_redis_binary_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    with pytest.raises(pytest.fail.Exception, match="apt-get install redis-server"):
        RedisServer(tmp_path)
