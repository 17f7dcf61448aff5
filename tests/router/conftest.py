"""A pool of real workers (2 prefill + 2 decode, float32, on the session's redis-server) and a
router process in front of them, for the router tests; and a reference engine."""

from __future__ import annotations

import openai
import pytest

from services.engine.engine import Engine, EngineConfig
from services.launcher import RouterProcess
from tests.support.cluster import addresses, start_workers


@pytest.fixture(scope="session")
def pool(redis_server, embedded_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pool-logs")
    prefill, decode = start_workers(
        str(embedded_dir), redis_server.url, logs, 2, 2, "--num-blocks", "400"
    )
    yield prefill, decode
    for w in (*prefill, *decode):
        w.stop()


@pytest.fixture(scope="session")
def router(pool, tmp_path_factory):
    """A kv_aware router over the pool."""
    prefill, decode = pool
    proc = RouterProcess(
        tmp_path_factory.mktemp("router-logs"), addresses(prefill), addresses(decode)
    ).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def engine(embedded):
    """The in-process engine the router's answers must equal (float32, as the workers)."""
    return Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=400))
