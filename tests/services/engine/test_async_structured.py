"""test_structured.py's tests, every engine stepping asynchronously (async_on.py), in float32:
test_structured.py runs them in every dtype, and test_async_scheduling.py compares async and
synchronous steps in each."""

import pytest

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_structured import *  # noqa: F403


@pytest.fixture(scope="module")
def model(embedded):
    return embedded
