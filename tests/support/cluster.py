"""Router tests' helpers: worker pools as processes, what the workers report, and what a
single in-process engine gives for the same request (the reference)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import WorkerProcess
from services.model.loader import LoadedModel, load_model
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg

MODEL = "SmolLM2-135M-Instruct"
T = TypeVar("T")
FIELD = re.compile(r'(\w+)=("[^"]*"|\S*)')  # a services/logs.py field: key=value or key="v a l"
Output = tuple[str, list[float]]  # a greedy choice's text and each token's logprob


def greedy_stream(
    client: openai.OpenAI,
    prompt: list[int],
    max_tokens: int,
    on_token: Callable[[], None] = lambda: None,
) -> Output:
    """A completion streamed at temperature 0, EOS ignored; `on_token` runs per token."""
    text, logprobs = "", []
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            text += c.text
            new = c.logprobs.token_logprobs if c.logprobs and c.logprobs.token_logprobs else []
            logprobs += new
            for _ in new:
                on_token()
    return text, logprobs


def greedy_in_process(
    loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, num_blocks: int
) -> list[Output]:
    """What `greedy_stream` should give for each prompt: the engine in this process."""
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=num_blocks))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outputs = engine.generate(prompts, params)
    return [(o.choices[0].text, [lp.logprob for lp in o.choices[0].logprobs]) for o in outputs]


def greedy_chat_in_process(question: str, max_tokens: int) -> str:
    """The embedded model's answer to one user message at temperature 0 (EOS honoured), from
    the engine in this process in the dtype `auto` picks on this CPU, as a server started with
    its defaults answers. (Its first token for "What is the capital of France?" is a near tie that
    bfloat16 logits once broke the wrong way: tests/services/engine/test_dtype_answers.py.)"""
    loaded = load_model("embedded", "auto", "cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": question}])
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return output.choices[0].text


def start_workers(
    model: str, store: str, logs: Path, prefill: int, decode: int, *args: str
) -> tuple[list[WorkerProcess], list[WorkerProcess]]:
    """`prefill` + `decode` float32 workers on `store`, started side by side."""
    p = [
        WorkerProcess("prefill", model, store, logs, *args, dtype="float32") for _ in range(prefill)
    ]
    d = [WorkerProcess("decode", model, store, logs, *args, dtype="float32") for _ in range(decode)]
    for w in (*p, *d):
        w.launch()
    try:
        for w in (*p, *d):
            w.wait_ready()
    except BaseException:  # none outlives a failed start
        for w in (*p, *d):
            w.stop()
        raise
    return p, d


def addresses(workers: Sequence[WorkerProcess]) -> list[str]:
    return [w.address for w in workers]


def load(worker: WorkerProcess) -> pb.LoadReply:
    async def ask() -> pb.LoadReply:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stubs: dict[str, Any] = {"prefill": pbg.PrefillWorkerStub,
                                     "encode": pbg.EncodeWorkerStub}  # fmt: skip
            stub_class = stubs.get(worker.role, pbg.DecodeWorkerStub)
            reply: pb.LoadReply = await stub_class(channel).Load(pb.LoadRequest(), timeout=2)
            return reply

    return asyncio.run(ask())


def wait_idle(workers: Sequence[WorkerProcess], timeout: float) -> float:
    """Seconds until every worker reports nothing running and no referenced block; raises
    after `timeout`."""
    start = time.monotonic()
    while True:
        loads = [load(w) for w in workers]
        if all(x.running == 0 and x.waiting == 0 and x.referenced_blocks == 0 for x in loads):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"workers still busy after {timeout}s: {loads}")
        time.sleep(0.02)


def log_size(worker: WorkerProcess) -> int:
    """Where the worker's next log line will start (for `log_events(worker, since=...)`)."""
    return worker.log_path.stat().st_size


def log_events(worker: WorkerProcess, since: int = 0) -> list[dict[str, str]]:
    """The worker's whole log lines from byte `since` on, each as its key=value fields."""
    with open(worker.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    lines = text[: text.rfind("\n") + 1].splitlines()  # a line still being written waits
    return [{k: v.strip('"') for k, v in FIELD.findall(line)} for line in lines]


def logged(
    workers: Sequence[WorkerProcess], since: Sequence[int], *msgs: str
) -> list[tuple[str, str]]:
    """(message, request id) of the workers' lines with one of these messages, logged after
    their logs' sizes `since`."""
    return [
        (e["msg"], e["request_id"])
        for w, at in zip(workers, since, strict=True)
        for e in log_events(w, at)
        if e.get("msg") in msgs
    ]


def wait_until(value: Callable[[], T], timeout: float) -> T:
    """`value()` once it is true; `timeout` only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not (result := value()):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing after {timeout}s")
        time.sleep(0.05)
    return result


def metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's /metrics, parsed by prometheus_client: (sample name, labels) -> value."""
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reference(engine: Engine, prompt: list[int], params: SamplingParams) -> list[str]:
    """Each choice's text from one in-process engine."""
    out = engine.generate([prompt], params)[0]
    return [c.text for c in out.choices]
