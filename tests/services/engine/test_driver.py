"""AsyncEngine, the engine's thread driven from asyncio: whatever callers do to their futures
(cancel before a command runs, while it runs, after; abandon a stream) the engine thread
keeps serving and nothing is left running; a thread that dies fails every caller and stream
at once; a thread that stops stepping with work queued shows as stalled."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from services.engine.driver import AsyncEngine, EngineDied
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest

PROMPT = list(range(1000, 1040))
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(embedded):
    return Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=400))


async def until_idle(driver: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while driver.engine.requests or driver.load.running or driver.load.waiting:
        assert time.monotonic() < deadline, f"still busy: {driver.load}"
        await asyncio.sleep(0.02)


async def first_delta_then_leave(driver: AsyncEngine, rid: str) -> None:
    stream = await driver.submit(EngineRequest(rid, PROMPT, LONG))
    async for _ in stream:
        return  # abandoned after one delta: the request must not keep running


def test_a_cancel_storm_leaves_the_engine_serving_and_idle(engine):
    async def run() -> list[int]:
        driver = AsyncEngine(engine)
        driver.start()
        rng = random.Random(0)
        for round_ in range(3):
            tasks = [
                asyncio.create_task(first_delta_then_leave(driver, f"r{round_}-{i}"))
                for i in range(200)
            ]
            await asyncio.sleep(0)
            for task in tasks:  # some before their add ran, some during a step, some after
                if rng.random() < 0.7:
                    task.cancel()
                if rng.random() < 0.1:
                    await asyncio.sleep(0.01)
            await asyncio.gather(*tasks, return_exceptions=True)
            calls = [asyncio.create_task(driver.call(lambda e: len(e.requests))) for _ in range(50)]
            for call in calls[::2]:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await until_idle(driver)
            assert driver.alive
        engine.check()
        assert engine.blocks.referenced_blocks() == 0
        stream = await driver.submit(EngineRequest("after", PROMPT, SHORT))
        tokens = [t for d in [d async for d in stream] for t in d.token_ids]
        await driver.stop()
        return tokens

    tokens = asyncio.run(run())
    assert tokens == engine.generate([PROMPT], SHORT)[0].choices[0].token_ids


def test_a_dead_engine_thread_fails_every_caller_and_stream_at_once(engine):
    async def run() -> None:
        driver = AsyncEngine(engine)
        driver.start()
        stream = await driver.submit(EngineRequest("long", PROMPT, LONG))
        await anext(stream)
        driver.kill()
        with pytest.raises(EngineDied, match="test hook"):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        assert not driver.alive and "_Killed" in (driver.failure or "")
        with pytest.raises(EngineDied):
            await driver.submit(EngineRequest("later", PROMPT, SHORT))
        driver.abort_soon("long")  # cleanup paths may still call it: no error
        await driver.stop()

    asyncio.run(run())


def test_a_thread_that_stops_stepping_with_work_queued_shows_as_stalled(engine):
    async def run() -> None:
        driver = AsyncEngine(engine)
        driver.start()
        assert driver.stalled_for() == 0.0  # idle is not stalled
        stream = await driver.submit(EngineRequest("long", PROMPT, LONG))
        await anext(stream)
        blocked = asyncio.create_task(driver.call(lambda e: time.sleep(1.5)))  # stuck 1.5 s
        await asyncio.sleep(1.2)
        assert driver.stalled_for() >= 1.0
        await blocked
        # stepping again: the heartbeat comes back once the next step ends (within a step's
        # time, however slow the machine; 10 s is far more than any)
        for _ in range(100):
            if driver.stalled_for() < 1.0:
                break
            await asyncio.sleep(0.1)
        assert driver.stalled_for() < 1.0
        await driver.abort("long")
        await driver.stop()

    asyncio.run(run())
