"""Fixtures shared by every test: the embedded model, loaded once per session; the cores
shared out among pytest-xdist's workers (`make test` runs two)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from services.model.loader import LoadedModel, load_model
from services.model.loading.sources import EMBEDDED, resolve


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes on its share of the cores, and so do the
    workers and stacks its tests start (OMP_NUM_THREADS, which they inherit): with every core
    each, a `pdserve up` stack beside the other worker's computing took 182 s instead of 15."""
    config.addinivalue_line(
        "markers",
        "all_cores: a guarantee checked with OpenMP's whole team (make test runs these after "
        "the rest, one at a time)",
    )
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded GGUF converted to a Hugging Face directory (cached between runs)."""
    return resolve(EMBEDDED)


@pytest.fixture(scope="session")
def embedded(embedded_dir) -> LoadedModel:
    """SmolLM2-135M-Instruct in float32: the dtype in which we must match transformers."""
    return load_model(str(embedded_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def reference(embedded_dir):
    """transformers' LlamaForCausalLM on the same dequantized weights, float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of the test session's own, on a free port."""
    from tests.support.redis_servers import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real three-node Redis Cluster, created with redis-cli."""
    from tests.support.redis_servers import RedisClusterServers

    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def workers(redis_server, embedded_dir, tmp_path_factory):
    """A prefill and a decode worker process sharing the session's redis-server (float32, so
    that their tokens can be compared with the single-process engine's)."""
    from tests.support.cluster import start_workers

    logs = tmp_path_factory.mktemp("worker-logs")
    (prefill,), (decode,) = start_workers(
        str(embedded_dir), redis_server.url, logs, 1, 1, "--num-blocks", "400"
    )
    yield prefill, decode
    prefill.stop()
    decode.stop()


# -- a disaggregated cluster of processes: 2 prefill + 2 decode workers (float32, on the
# session's redis-server; the decode workers speculate) and a kv_aware router in front of
# them, and the in-process engine whose answers the cluster's must equal


@pytest.fixture(scope="session")
def pool(redis_server, embedded_dir, tmp_path_factory):
    from tests.support.cluster import start_workers

    logs = tmp_path_factory.mktemp("pool-logs")
    # the decode workers speculate (suffix: prompt lookup and recent outputs): every answer
    # of the router tests, faults included, equals the engine's without speculation
    prefill, decode = start_workers(
        str(embedded_dir), redis_server.url, logs, 2, 2, "--num-blocks", "400",
        "--speculative", "suffix",
    )  # fmt: skip
    yield prefill, decode
    for w in (*prefill, *decode):
        w.stop()


@pytest.fixture(scope="session")
def router(pool, tmp_path_factory):
    """A kv_aware router over the pool."""
    from services.launcher import RouterProcess
    from tests.support.cluster import addresses

    prefill, decode = pool
    proc = RouterProcess(
        tmp_path_factory.mktemp("router-logs"), addresses(prefill), addresses(decode)
    ).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(router):
    import openai

    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def engine(embedded):
    """The in-process engine the router's answers must equal (float32, as the workers)."""
    from services.engine.engine import Engine, EngineConfig

    return Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=400))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, embedded_dir):
    """The tiny checkpoint of a family (tests/support/tiny_models.FAMILIES), saved on first
    use."""
    from tests.support.tiny_models import save_tiny

    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            made[family] = tmp_path_factory.mktemp(family)
            save_tiny(family, made[family], embedded_dir)
        return made[family]

    return get
