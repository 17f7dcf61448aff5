"""test_engine.py's tests, every engine stepping asynchronously (async_on.py). The 64 requests
under preemption are not run again here: test_async_scheduling.py compares async steps that
preempt with synchronous ones for every family and dtype."""

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_engine import *  # noqa: F403

del test_64_requests_under_preemption_match_the_batch_without_it_and_alone  # noqa: F821


def test_the_engines_here_step_asynchronously(embedded):
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig())  # noqa: F405
    assert eng.flight.overlap
