"""The OpenAI request bodies the router accepts, validated at the edge.

Unknown fields are refused (400 naming the field) rather than silently ignored, and types are
strict as in OpenAI's API: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not coerced
(an integer is accepted where a number is expected). The fields beyond OpenAI's (top_k,
min_p, repetition_penalty, ignore_eos, min_tokens, ...) are vLLM's, so clients written for
vLLM work unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields completions and chat share."""

    model: str | None = None  # optional, as in vLLM: the one served model
    n: Annotated[int, Field(ge=1)] = 1  # at most RouterConfig.max_n
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: None = None  # accepted only as null: insertion is not supported


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class WorkerChange(Strict):
    role: Literal["prefill", "decode"]
    address: str
