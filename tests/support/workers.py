"""Talking to real worker processes (services.launcher starts them) the way the router does."""

from __future__ import annotations

from services.launcher import WorkerProcess
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg

__all__ = ["WorkerProcess", "disaggregated"]


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
        request_id=request_id,
        prompt_token_ids=prompt,
        output_token_ids=[reply.first_token],
        params=params,
        seed=seed,
        text_sent=len(reply.text),
    )
    async for chunk in decode.Decode(request):
        tokens += chunk.token_ids
        text += chunk.text
    return tokens, text, reply
