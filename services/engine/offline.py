"""Running prompts to completion in the caller's thread (`Engine.generate`, `pdserve generate`)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Protocol

from services.engine.outputs import Choice, RequestOutput, SequenceDelta
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, Sequence
from services.tokenizer.tokenizer import Tokenizer


class _Held(Protocol):
    seqs: list[Sequence]


class Runner(Protocol):
    """What running prompts takes of the engine (services/engine/engine.py)."""

    tokenizer: Tokenizer

    @property
    def requests(self) -> Mapping[str, _Held]: ...
    @property
    def has_unfinished(self) -> bool: ...
    def add_request(self, request: EngineRequest) -> None: ...
    def step(self) -> list[SequenceDelta]: ...


def generate(
    engine: Runner,
    prompts: Seq[Seq[int] | str],
    params: SamplingParams | Seq[SamplingParams],
    id_prefix: str,
) -> list[RequestOutput]:
    """Run prompts (token ids or text) to completion; outputs in the prompts' order."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    ids = [f"{id_prefix}-{i}" for i in range(len(prompts))]
    token_lists = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    for rid, tokens, p in zip(ids, token_lists, per_prompt, strict=True):
        engine.add_request(EngineRequest(rid, tokens, p))
    seqs = {rid: engine.requests[rid].seqs for rid in ids}
    while engine.has_unfinished:
        engine.step()
    return [
        RequestOutput(
            request_id=rid,
            prompt_ids=tokens,
            num_cached_tokens=seqs[rid][0].num_cached_tokens,
            choices=[Choice.of(s) for s in seqs[rid]],
            prompt_logprobs=list(seqs[rid][0].prompt_logprobs),
        )
        for rid, tokens in zip(ids, token_lists, strict=True)
    ]
