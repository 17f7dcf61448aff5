"""test_speculative.py's tests, every engine stepping asynchronously (async_on.py): n-gram and
suffix proposals verified before each step, their text applied while it computes
(services/engine/inflight.py: tokens placed early), give the outputs of the engine without
them. In float32 here; test_async_speculation.py compares with the synchronous engine in every
dtype, greedy and seeded, which is why the 32 greedy prompts are not run again here."""

import pytest

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_speculative import *  # noqa: F403

del test_greedy_32_prompts_are_token_identical_with_speculation  # noqa: F821


@pytest.fixture(scope="module")
def model(embedded):
    return embedded


def test_the_speculating_engines_here_step_asynchronously(embedded):
    eng = engine(embedded, NGRAM)  # noqa: F405
    assert eng.flight.overlap and eng.flight.early
