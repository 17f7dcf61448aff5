"""Between the wire (services.rpc, generated from proto/worker.proto) and the engine's types.

Validation happens here, at the edge: a request becomes engine types or a ValidationError
naming the field; the engine never sees a raw message.
"""

from __future__ import annotations

from typing import Any, Protocol

from google.protobuf.message import Message

from kvstore.store import StoreStats
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import FinishReason, TokenLogprobs
from services.rpc import worker_pb2 as pb

FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.HANDED_OFF: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
# the wire's reasons as the OpenAI API names them ("stop", "length", "abort"); none: running
FINISH_NAMES = {
    wire: reason.value
    for reason, wire in FINISH.items()
    if reason is not None and wire != pb.FINISH_REASON_UNSPECIFIED
}


def check_no_unknown_fields(message: Message, name: str = "request") -> None:
    """A field this worker does not know (a newer router?) is refused, not silently dropped."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise ValidationError(name, f"unknown field number {unknown[0].field_number}")
    for field, value in message.ListFields():
        if field.message_type is not None and not field.is_repeated:
            check_no_unknown_fields(value, field.name)


# SamplingParams fields the wire carries as they are; OPTIONAL ones are proto3 `optional`
# (absent: SamplingParams' default). The rest are converted by hand below.
PLAIN = ("max_tokens", "min_p", "presence_penalty", "frequency_penalty", "min_tokens",
         "ignore_eos", "include_stop_str_in_output")  # fmt: skip
OPTIONAL = ("temperature", "top_p", "top_k", "repetition_penalty", "skip_special_tokens")
# what a user sets by name, a null meaning the default (the router's SamplingFields; the
# router derives max_tokens itself)
USER_FIELDS = tuple(f for f in (*PLAIN, *OPTIONAL) if f != "max_tokens")


def sampling_params(p: pb.SamplingParams, seed: int) -> SamplingParams:
    values = {f: getattr(p, f) for f in PLAIN}
    values |= {f: getattr(p, f) for f in OPTIONAL if p.HasField(f)}
    return SamplingParams(
        **values,
        logit_bias=dict(p.logit_bias),
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=seed,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        grammar=p.grammar if p.HasField("grammar") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def reuse(request: pb.PrefillRequest | pb.DecodeRequest) -> dict[str, Any]:
    """A Prefill's or Decode's KV reuse, as EngineRequest's fields (the engine checks them)."""
    return {
        "kv_reuse": request.kv_reuse or None,
        "chunks": tuple((c.start, c.end) for c in request.chunks),
    }


def to_proto_params(p: SamplingParams) -> pb.SamplingParams:
    """The inverse, for clients (the router, tests)."""
    out = pb.SamplingParams(
        **{f: getattr(p, f) for f in (*PLAIN, *OPTIONAL)},
        logit_bias=dict(p.logit_bias),
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
    )
    if p.logprobs is not None:
        out.logprobs = p.logprobs
    if p.grammar is not None:
        out.grammar = p.grammar
    if p.prompt_logprobs is not None:
        out.prompt_logprobs = p.prompt_logprobs
    return out


def logprobs_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
        rank=lp.rank,
    )


class Serving(Protocol):
    """What Health reports of a process serving a deployment's KV layout (a worker, an
    encoder)."""

    role: str
    model_name: str
    namespace: str

    @property
    def ready(self) -> bool: ...

    @property
    def block_size(self) -> int: ...


def health_reply(serving: Serving) -> pb.HealthReply:
    return pb.HealthReply(
        role=serving.role,
        model=serving.model_name,
        ready=serving.ready,
        namespace=serving.namespace,
        block_size=serving.block_size,
    )


def store_load(stats: StoreStats, encoded: int, from_store: int) -> dict[str, int]:
    """Load's fields of a process's store and images (LoadReply keywords)."""
    return {
        "store_hits": stats.hits - stats.corrupt,
        "store_corrupt": stats.corrupt,
        "store_unavailable": stats.unavailable,
        "store_misses": stats.misses,
        "store_writes": stats.puts,
        "store_bytes_read": stats.bytes_read,
        "store_bytes_written": stats.bytes_written,
        "images_encoded": encoded,
        "images_from_store": from_store,
    }
