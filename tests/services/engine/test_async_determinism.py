"""test_determinism.py's tests, every engine stepping asynchronously (async_on.py)."""

import pytest

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_determinism import *  # noqa: F403


@pytest.fixture(scope="module", params=["embedded", "deepseek_v3"])
def family(request):
    """Llama-style attention and DeepSeek-V3 here; test_async_scheduling.py compares every
    family with synchronous steps."""
    return request.param
