"""The engine's suites again with async scheduling on (services/engine/inflight.py): a
test_async_<suite>.py module imports its suite's tests and this fixture, and every engine its
tests make steps asynchronously (module scope: before the suite's own module fixtures)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.engine import engine as engine_module


@pytest.fixture(scope="module", autouse=True)
def async_steps() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "async_scheduling", lambda _setting, _device: True)
        yield
