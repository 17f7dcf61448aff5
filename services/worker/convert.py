"""Between the wire (services.rpc, generated from proto/worker.proto) and the engine's types.

Validation happens here, at the edge: a request becomes engine types or a ValidationError
naming the field; the engine never sees a raw message.
"""

from __future__ import annotations

from google.protobuf.message import Message

from services.engine.params import SamplingParams, ValidationError
from services.engine.request import FinishReason, TokenLogprobs
from services.rpc import worker_pb2 as pb

FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.PREFILLED: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
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


def sampling_params(p: pb.SamplingParams, seed: int) -> SamplingParams:
    def opt(field: str, default: float | int | bool) -> float | int | bool:
        return getattr(p, field) if p.HasField(field) else default

    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=float(opt("temperature", 1.0)),
        top_p=float(opt("top_p", 1.0)),
        top_k=int(opt("top_k", -1)),
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=float(opt("repetition_penalty", 1.0)),
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        seed=seed,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=bool(opt("skip_special_tokens", True)),
    )


def to_proto_params(p: SamplingParams) -> pb.SamplingParams:
    """The inverse, for clients (the router, tests)."""
    out = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.logprobs is not None:
        out.logprobs = p.logprobs
    return out


def logprobs_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
    )
