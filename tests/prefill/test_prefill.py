"""The prefill worker: prefix reuse from the store, and requests it refuses (and survives)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.support.workers import disaggregated

PARAMS = to_proto_params(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_with_stubs(workers, body):
    async def go():
        prefill, decode = workers
        async with (
            grpc.aio.insecure_channel(prefill.address) as pch,
            grpc.aio.insecure_channel(decode.address) as dch,
        ):
            return await body(pbg.PrefillWorkerStub(pch), pbg.DecodeWorkerStub(dch))

    return asyncio.run(go())


def test_a_shared_1000_token_prefix_is_not_computed_again(workers):
    # seeds no other test uses: the workers are shared, and so are their caches
    shared = prompt(1000, seed=5005)
    first, second = shared + prompt(40, seed=5006), shared + prompt(25, seed=5007)

    async def body(prefill, decode):
        a = await prefill.Prefill(
            pb.PrefillRequest(request_id="p1", prompt_token_ids=first, params=PARAMS, seed=1)
        )
        b = await prefill.Prefill(
            pb.PrefillRequest(request_id="p2", prompt_token_ids=second, params=PARAMS, seed=1)
        )
        return a, b

    a, b = run_with_stubs(workers, body)
    assert a.computed_tokens == 1040 and a.cached_tokens == 0
    # 62 full blocks (992 tokens) shared; at most one block of the prefix is computed again
    assert b.cached_tokens == 992
    assert b.computed_tokens == 1025 - 992 <= 16 + 25


def _refused(workers, call) -> grpc.aio.AioRpcError:
    async def body(prefill, decode):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(prefill, decode)
        return err.value

    return run_with_stubs(workers, body)


def _prefill(**fields):
    fields.setdefault("params", PARAMS)
    return lambda prefill, decode: prefill.Prefill(pb.PrefillRequest(**fields))


def _decode(**fields):
    fields.setdefault("params", PARAMS)

    async def call(prefill, decode):
        async for _ in decode.Decode(pb.DecodeRequest(**fields)):
            pass

    return call


async def _decode_with_block_hashes(prefill, decode):
    """A caller handing a decode worker block hashes (field 4, once DecodeRequest.block_hashes,
    now reserved): refused; a worker reads KV only under hashes it computes itself."""
    raw = pb.DecodeRequest(
        request_id="h", prompt_token_ids=list(range(100, 140)), output_token_ids=[5], params=PARAMS
    )
    message = pb.DecodeRequest()
    message.ParseFromString(raw.SerializeToString() + b"\x22\x20" + b"\x00" * 32)  # 4: 32 bytes
    async for _ in decode.Decode(message):
        pass


def _with_unknown_field(prefill, decode):
    raw = pb.PrefillRequest(request_id="u", prompt_token_ids=[1, 2], params=PARAMS)
    message = pb.PrefillRequest()  # protobuf keeps the fields it does not know, and sends them
    message.ParseFromString(raw.SerializeToString() + bytes([0xF8, 0x01, 0x07]))  # field 31 = 7
    return prefill.Prefill(message)


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (
            _prefill(request_id="e", prompt_token_ids=[]),
            "INVALID_ARGUMENT",
            "prompt: must not be empty",
        ),
        (
            _prefill(request_id="v", prompt_token_ids=[1, 60000]),
            "INVALID_ARGUMENT",
            "prompt: token id 60000 is outside the vocabulary",
        ),
        (
            _prefill(
                request_id="w",
                prompt_token_ids=[1] * 10,
                params=to_proto_params(SamplingParams(max_tokens=8190)),
            ),
            "INVALID_ARGUMENT",
            "max_tokens: prompt (10 tokens) plus max_tokens (8190) exceeds the context window",
        ),
        (
            _prefill(
                request_id="t",
                prompt_token_ids=[1, 2],
                params=to_proto_params(SamplingParams(top_p=1.5)),
            ),
            "INVALID_ARGUMENT",
            "top_p: must be in (0, 1]",
        ),
        (
            _prefill(
                request_id="k",
                prompt_token_ids=[1, 2],
                params=to_proto_params(SamplingParams(top_k=49153)),
            ),
            "INVALID_ARGUMENT",
            "top_k: must be -1 or 0 (off), or 1..49152",
        ),
        (
            _decode(
                request_id="kd",
                prompt_token_ids=[1, 2],
                params=to_proto_params(SamplingParams(top_k=1 << 30)),
                local_prefill=True,
            ),
            "INVALID_ARGUMENT",
            "top_k: must be -1 or 0 (off), or 1..49152",
        ),
        (_with_unknown_field, "INVALID_ARGUMENT", "request: unknown field number 31"),
        (_decode_with_block_hashes, "INVALID_ARGUMENT", "request: unknown field number 4"),
    ],
    ids=[
        "empty",
        "vocabulary",
        "context",
        "top_p",
        "top_k",
        "top_k-decode",
        "unknown-field",
        "block-hashes",
    ],
)
def test_bad_input_is_refused_and_the_workers_keep_serving(workers, call, code, message):
    err = _refused(workers, call)
    assert err.code().name == code
    assert message in err.details()

    async def body(prefill, decode):
        return await disaggregated(
            prefill, decode, f"after-{code}-{message[:8]}", [1, 2, 3], PARAMS, seed=1
        )

    tokens, _, _ = run_with_stubs(workers, body)
    assert len(tokens) == 8


def test_a_request_id_already_running_is_refused(workers):
    async def body(prefill, decode):
        ids = prompt(40, seed=9)
        params = to_proto_params(SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        reply = await prefill.Prefill(
            pb.PrefillRequest(request_id="dup", prompt_token_ids=ids, params=params, seed=1)
        )
        request = pb.DecodeRequest(
            request_id="dup",
            prompt_token_ids=ids,
            output_token_ids=[reply.first_token],
            params=params,
            seed=1,
        )
        first = decode.Decode(request)
        await first.read()  # running now
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode.Decode(request):
                pass
        first.cancel()
        return err.value

    err = run_with_stubs(workers, body)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in err.details()
