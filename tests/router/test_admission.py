"""The requests-in-flight count behind 429s gives every place back: after a request, after a
stream the server never started (its client left first), and never twice."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from router.api import stream_events
from router.config import RouterConfig
from router.errors import APIError
from router.openai_format import Envelope
from router.state import RouterState


def test_places_are_given_back_once_even_by_unstarted_streams():
    state = RouterState.create(RouterConfig(max_pending=2))
    first, second = state.admit(), state.admit()
    with pytest.raises(APIError) as refused:
        state.admit()
    assert refused.value.status == 429 and state.pending == 2
    first.release()
    first.release()
    assert state.pending == 1

    envelope = Envelope("id", "text_completion", 0, "m")
    body = stream_events(state, [], second, False, lambda *a: {}, envelope, None, 0)
    weakref.finalize(body, second.release)  # as respond() does
    del body
    gc.collect()
    assert state.pending == 0
    assert state.metrics.waiting._value.get() == 0


def test_a_finished_run_gives_its_place_back():
    state = RouterState.create(RouterConfig())
    admission = state.admit()

    async def drain() -> None:
        async for _ in state.run([], admission):
            pass

    asyncio.run(drain())
    assert state.pending == 0 and admission.released
