"""test_driver.py's tests, every engine stepping asynchronously (async_on.py)."""

from tests.services.engine.async_on import async_steps  # noqa: F401
from tests.services.engine.test_driver import *  # noqa: F403
