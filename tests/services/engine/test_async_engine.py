"""test_engine.py's tests, every engine stepping asynchronously (async_on.py)."""

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_engine import *  # noqa: F403


def test_the_engines_here_step_asynchronously(embedded):
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig())  # noqa: F405
    assert eng.flight.overlap
