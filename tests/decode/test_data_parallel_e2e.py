"""`pdserve up --data-parallel 2` over a MoE checkpoint made by transformers: the prefill
worker and the decode worker each become two ranks, whole engines with half the experts each,
every one a target of the router; concurrent requests, spread over the ranks, answer as one
process does through the router and the official client (a prompt prefilled by either prefill
rank is decoded by either decode rank: the store's keys name no rank); a decode rank killed
mid-stream takes its group out of service (both ranks exit 1, restarted by `up`) and the
stream completes after the restart, token for token; nothing hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import openai
import psutil
import pytest

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import RouterProcess, WorkerProcess, free_port, wait_for_port
from services.model.loader import load_model
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.services.engine.test_determinism import prompt
from tests.support.cluster import metrics
from tests.support.up import Up, stream_completion
from tests.support.workers import disaggregated

PROMPTS = [f"Story {i}: the lighthouse keeper climbed the stairs and" for i in range(6)]
NAME = "tiny-moe"


@pytest.mark.parametrize(
    ("family", "tensor"), [("qwen3_moe", 1), ("deepseek_v3", 2)], ids=["dp2", "dp2xtp2"]
)
def test_ranks_answer_as_one_process_and_a_dead_rank_restarts_its_group(tiny_dir, family, tensor):
    """DP 2 of a Qwen3-MoE; DP 2 x TP 2 of a DeepSeek-V3 (its latent cache whole on each
    tensor rank; four processes, a rank's tensor rank its child: the one killed is a tensor
    rank). Colocated: the decode ranks compute the prompts (the store's side of a split pool:
    tests/services/model/test_tensor_parallel.py)."""
    path = tiny_dir(family)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.choices[0].text for o in engine.generate(PROMPTS, params)]
    metrics = _port_pair()  # decode rank k's side door on metrics + k
    out = Up("--port", str(free_port()), "--model", str(path), "--served-model-name", NAME,
             "--kv-store", "memory://", "--num-blocks", "128", "--dtype", "float32",
             "--colocated", "--data-parallel", "2", "--tensor-parallel", str(tensor),
             "--metrics-port", str(metrics))  # fmt: skip
    ranks: list[psutil.Process] = []
    try:
        base = out.ready()
        _every_rank_healthy(base.removesuffix("/v1"), 2, out)  # else one ready late gets none
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

        def complete(prompt: str) -> str:
            args = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "extra_body": {"ignore_eos": True}}  # fmt: skip
            return client.completions.create(**args).choices[0].text  # type: ignore[arg-type]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
        for k in range(2):  # every rank computed tokens of its own: the router spread them
            shown = httpx.get(f"http://127.0.0.1:{metrics + k}/experts").json()
            assert shown["data_parallel"]["rank"] == k % 2 and shown["data_parallel"]["votes"] > 0
            routed = sum(sum(counts) for counts in shown["layers"].values())
            assert routed > 0, f"worker {k} computed no tokens"

        pids = [int(out.wait_for(rf"pdserve: decode-{r} started \(pid (\d+)\)", 5).group(1))
                for r in range(2)]  # fmt: skip
        ranks = [psutil.Process(pid) for pid in pids]
        if tensor > 1:  # rank 1's tensor rank
            ranks += [p for p in ranks[1].children() if "parallel.ranks" in p.cmdline()[2]]
        mark = len(out.lines)
        args = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                "extra_body": {"ignore_eos": True}}  # fmt: skip
        kill = lambda: ranks[-1].send_signal(signal.SIGKILL)  # noqa: E731  (mid-stream)
        text, finishes = stream_completion(client, args, 5, kill)
        for r in range(2):  # rank 0 found its peer gone at its next vote
            out.wait_for(rf"pdserve: decode-{r} exited with code -?[1-9]\d*; restarting", 30, mark)
        assert text == expected[0] and finishes == ["length"]  # completed after the restart
        assert complete(PROMPTS[1]) == expected[1]
    finally:
        out.stop()
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_pair() -> int:
    """A free port whose next is free too (rank 1 takes port + 1): ephemeral ports of the
    other tests' connections land anywhere, and a rank that cannot bind exits."""
    while not _bindable((port := free_port()) + 1):
        pass
    return port


def _group_worker(role: str, path: str, store: str, tmp_path, *args: str) -> WorkerProcess:
    """A worker started with `--data-parallel 2` (ARGS), on a port whose next is free."""
    while True:
        worker = WorkerProcess(role, path, store, tmp_path, *args, dtype="float32")
        if _bindable(worker.port + 1):
            return worker


def _wait_for_rank_1(worker: WorkerProcess) -> None:
    try:
        wait_for_port(worker.port + 1, timeout=120)
    except RuntimeError as e:
        raise AssertionError(f"{e}; the group's log:\n{worker.log_path.read_text()}") from e


def _every_rank_healthy(
    router: str, ranks: int, out: Up | None = None, timeout: float = 180
) -> None:
    """Wait until the router has found every rank healthy (up says ready at the first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        healthy = [
            v for (name, _), v in metrics(router).items() if name == "pdserve_worker_healthy"
        ]
        if len(healthy) == ranks and all(healthy):
            return
        time.sleep(0.2)
    shown = "\n".join(out.lines) if out is not None else ""
    raise AssertionError(f"not every one of {ranks} ranks healthy in {timeout}s:\n{shown}")


def _expected(path: str, max_tokens: int = 16) -> list[str]:
    loaded = load_model(path, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.choices[0].text for o in engine.generate(PROMPTS, params)]


@contextlib.contextmanager
def _group_behind_router(path: str, tmp_path, *args: str) -> Iterator[Callable[[str], str]]:
    """`pdserve decode --data-parallel 2 ARGS` alone (as in a container: it starts rank 1 on
    the next port itself) and a router listing both ports (colocated: the decode ranks
    compute the prompts); yields a prompt's completion through the official client; the
    whole group stopped after, rank 1 waited for (it goes with its rank 0)."""
    decode = _group_worker("decode", path, "memory://", tmp_path, "--data-parallel", "2",
                           "--num-blocks", "128", *args).start()  # fmt: skip
    router = None
    try:
        _wait_for_rank_1(decode)
        router = RouterProcess(tmp_path, [], [decode.address, f"127.0.0.1:{decode.port + 1}"],
                               "--model", path, "--served-model-name", NAME,
                               "--disagg-threshold", str(1 << 30)).start()  # fmt: skip
        _every_rank_healthy(router.url, 2)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)

        def complete(text: str) -> str:
            extra = {"ignore_eos": True}
            reply = client.completions.create(
                model=NAME, prompt=text, max_tokens=16, temperature=0, extra_body=extra
            )
            return reply.choices[0].text

        (sibling,) = psutil.Process(decode.process.pid).children()  # type: ignore[union-attr]
        yield complete
    finally:
        if router is not None:
            router.stop()
        decode.stop()
    sibling.wait(30)


def test_one_command_starts_its_group_and_each_rank_is_a_target(tiny_dir, tmp_path):
    """A MoE model's group: concurrent requests answer as one process, both ranks
    computing; the whole group goes when rank 0 is stopped."""
    path = str(tiny_dir("qwen3_moe"))
    expected = _expected(path)
    metrics = _port_pair()
    with _group_behind_router(path, tmp_path, "--metrics-port", str(metrics)) as complete:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
        for r in range(2):
            shown = httpx.get(f"http://127.0.0.1:{metrics + r}/experts").json()
            assert shown["data_parallel"]["rank"] == r
            assert sum(sum(c) for c in shown["layers"].values()) > 0, f"rank {r} computed none"
        # a new placement asked of rank 1 is planned by both ranks at one pass
        plans = lambda: [  # noqa: E731
            httpx.get(f"http://127.0.0.1:{metrics + r}/experts").json()["data_parallel"][
                "rebalances"
            ]
            for r in range(2)
        ]
        before = plans()
        assert httpx.post(f"http://127.0.0.1:{metrics + 1}/experts/rebalance").status_code == 202
        assert complete(PROMPTS[0]) == expected[0]
        assert plans() == [before[0] + 1, before[1] + 1]


def test_a_dense_models_ranks_are_replicas_behind_the_router(tiny_dir, tmp_path):
    """A dense model's group: two replicas (no exchange, no votes), both targets of the
    router, answering as one process; no experts to rebalance (409)."""
    path = str(tiny_dir("qwen3"))
    expected = _expected(path)
    metrics = _port_pair()
    with (
        _group_behind_router(path, tmp_path, "--metrics-port", str(metrics)) as complete,
        concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool,
    ):
        assert list(pool.map(complete, PROMPTS)) == expected
        refused = httpx.post(f"http://127.0.0.1:{metrics}/experts/rebalance")
        assert refused.status_code == 409 and "no experts spread" in refused.text


def test_a_prompt_prefilled_by_one_rank_is_decoded_by_another(tiny_dir, redis_server, tmp_path):
    """`pdserve prefill --data-parallel 2` and `pdserve decode --data-parallel 2` over one
    Redis: a prompt prefilled by prefill rank i is decoded by decode rank j (i != j), its
    blocks read from the store (the store's keys name no rank), tokens as one process's."""
    path = str(tiny_dir("qwen3_moe"))
    loaded = load_model(path, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    args = ["--data-parallel", "2", "--num-blocks", "128"]
    groups = [
        _group_worker(role, path, redis_server.url, tmp_path, *args).launch()
        for role in ("prefill", "decode")
    ]
    try:
        for group in groups:
            group.wait_ready(120)
            _wait_for_rank_1(group)
        prefill, decode = ([f"127.0.0.1:{g.port + r}" for r in range(2)] for g in groups)

        async def one(i: int, j: int, ids: list[int]) -> tuple[list[int], int]:
            async with (
                grpc.aio.insecure_channel(prefill[i]) as pch,
                grpc.aio.insecure_channel(decode[j]) as dch,
            ):
                prefiller, decoder = pbg.PrefillWorkerStub(pch), pbg.DecodeWorkerStub(dch)
                await _ready(prefiller)
                await _ready(decoder)
                hits = (await decoder.Load(pb.LoadRequest())).store_hits
                rid, wire = f"p{i}-d{j}", to_proto_params(params)
                tokens, _, _ = await disaggregated(prefiller, decoder, rid, ids, wire, 0)
                return tokens, (await decoder.Load(pb.LoadRequest())).store_hits - hits

        for n, (i, j) in enumerate(((0, 1), (1, 0))):
            ids = prompt(40, seed=700 + n)  # 2 full blocks and a partial one
            tokens, read = asyncio.run(one(i, j, ids))
            assert tokens == engine.generate([ids], params)[0].choices[0].token_ids
            assert read == 3, (i, j)
    finally:
        for group in groups:
            group.stop()


async def _ready(stub: pbg.PrefillWorkerStub | pbg.DecodeWorkerStub, timeout: float = 60) -> None:
    """Until the rank answers Health ready (rank 1 may come up after rank 0)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await stub.Health(pb.HealthRequest())).ready:
                return
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < deadline, "rank not serving"
        await asyncio.sleep(0.2)
