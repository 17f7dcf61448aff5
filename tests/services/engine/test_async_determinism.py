"""test_determinism.py's tests, every engine stepping asynchronously (async_on.py)."""

import pytest

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_determinism import *  # noqa: F403


@pytest.fixture(scope="module", params=["embedded", "deepseek_v3"])
def family(request):
    """Llama-style attention and DeepSeek-V3 here, in float32; test_async_scheduling.py compares
    every family in every dtype with synchronous steps (the same pipeline with nothing left in
    flight), and test_determinism.py checks the guarantees in each."""
    return request.param


@pytest.fixture(scope="module")
def dtype() -> str:
    return "float32"
