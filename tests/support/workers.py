"""Prefill and decode workers as real processes (`pdserve prefill|decode`), for tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from tests.support.redis_servers import free_port

PDSERVE = str(Path(sys.executable).parent / "pdserve")


class WorkerProcess:
    def __init__(self, role: str, model: str, kv_store: str, log_dir: Path, *args: str) -> None:
        self.role = role
        self.port = free_port()
        self.log_path = log_dir / f"{role}-{self.port}.log"
        self.command = [
            PDSERVE, role, "--port", str(self.port), "--model", model, "--dtype", "float32",
            "--device", "cpu", "--kv-store", kv_store, *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> WorkerProcess:
        env = dict(os.environ, PDSERVE_LOG_LEVEL="info")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} exited: {self.log_path.read_text()[-2000:]}")
            if asyncio.run(self.healthy()):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"{self.role} not ready in {timeout}s: {self.log_path.read_text()}")

    async def healthy(self) -> bool:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = (
                pbg.PrefillWorkerStub(channel)
                if self.role == "prefill"
                else pbg.DecodeWorkerStub(channel)
            )
            try:
                reply = await stub.Health(pb.HealthRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.ready)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process is None:
            return 0
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code


async def disaggregated(
    prefill: pbg.PrefillWorkerStub,
    decode: pbg.DecodeWorkerStub,
    request_id: str,
    prompt: list[int],
    params: pb.SamplingParams,
    seed: int,
) -> tuple[list[int], str, pb.PrefillReply]:
    """What the router does for one request: Prefill, then Decode; all tokens and text."""
    reply = await prefill.Prefill(
        pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, params=params, seed=seed)
    )
    tokens, text = [reply.first_token], reply.text
    if reply.finish_reason:
        return tokens, text, reply
    request = pb.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, output_token_ids=[reply.first_token],
        block_hashes=reply.block_hashes, params=params, seed=seed,
    )  # fmt: skip
    async for chunk in decode.Decode(request):
        tokens += chunk.token_ids
        text += chunk.text
    return tokens, text, reply
