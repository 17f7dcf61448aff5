"""The OpenAI request bodies the router accepts, validated at the edge.

Fields the router does not use are ignored, as vLLM and OpenAI ignore them (`service_tier`,
`metadata`, a message's extra keys: clients and frameworks send them every day); their names
are logged at debug level. Every field the router does use is strictly typed as in OpenAI's
API: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not coerced (an integer is accepted
where a number is expected). The fields beyond OpenAI's (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, structured_outputs, ...) are vLLM's, so clients written for vLLM work
unchanged.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.engine.params import (
    DEFAULT_MAX_TOKENS,
    LOGIT_BIAS_LIMIT,
    MAX_LOGPROBS,
    PENALTY_LIMIT,
)

log = logging.getLogger("pdserve.router")


class Strict(BaseModel):
    """Known fields strictly typed; unknown ones refused (the router's own admin API)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Tolerant(BaseModel):
    """Known fields strictly typed; unknown ones ignored, their names logged at debug."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
            ignored = sorted(str(k) for k in data if k not in cls.model_fields)
            if ignored:
                fields = {"in": cls.__name__, "names": ",".join(ignored)}
                log.debug("ignored fields", extra={"fields": fields})
        return data


class StreamOptions(Tolerant):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class JsonSchemaFormat(Tolerant):
    name: str = "response"  # OpenAI requires it; it names the schema and changes nothing here
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Tolerant):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Tolerant):
    """vLLM's `structured_outputs` (one of them)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # how JSON is generated (router/completions/structured.py; also for response_format and tools):
    # compact, no whitespace between tokens (default: whitespace as the model likes, runs of
    # at most WHITESPACE_RUN)
    disable_any_whitespace: bool | None = None
    # false: properties a schema does not name may be generated where it does not say
    # `additionalProperties` (default: not, as vLLM's xgrammar; array items likewise)
    disable_additional_properties: bool | None = None


class SamplingFields(Tolerant):
    """Fields completions and chat share."""

    model: str | None = None  # optional, as in vLLM: the one served model
    n: Annotated[int, Field(ge=1)] = 1  # at most RouterSettings.max_n
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    logit_bias: (
        dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None
    ) = None
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
    # structured output (router/completions/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prompt's logprobs (each token after the first) with this many top ones
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # pdserve's: reuse of KV computed for other prompts (services/engine/chunk_reuse.py):
    # exact (cached prefixes) or approximate (also chunks found where others computed them);
    # none: the workers' --kv-reuse
    kv_reuse: Literal["exact", "approximate"] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: with echo, score the prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None  # >= n: the n best by cumulative logprob
    suffix: None = None  # accepted only as null: insertion is not supported
    # pdserve's: a text prompt's pieces between occurrences of this string are chunks that
    # approximate KV reuse may find again (router/completions/chunks.py)
    chunk_separator: Annotated[str, Field(min_length=1)] | None = None


class TextPart(Tolerant):
    type: Literal["text"]
    text: str


class ImageUrl(Tolerant):
    url: str  # a data: URL; file:// under allowed_local_media_path; http(s) from
    # allowed_media_domains (router/completions/images.py)
    detail: Literal["auto", "low", "high"] = "auto"  # accepted; the served models see one size


class ImagePart(Tolerant):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Tolerant):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Tolerant):
    """A call an earlier assistant turn made (a history being replayed)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Tolerant):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            return "".join(part.text for part in content if isinstance(part, TextPart))
        return content or ""

    @property
    def images(self) -> list[ImageUrl]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url for part in self.content if isinstance(part, ImagePart)]

    def as_template_input(self, image_text: str | None = None) -> dict[str, Any]:
        """The message as a chat template reads it. With images: its parts as a list
        ({"type": "text", "text": ...}, {"type": "image"}) for a template that reads parts
        (`image_text` None), else its text with `image_text` where each image goes."""
        role = "system" if self.role == "developer" else self.role
        if not self.images:
            return {"role": role, "content": self.text}
        assert isinstance(self.content, list)
        if image_text is not None:
            pieces = [p.text if isinstance(p, TextPart) else image_text for p in self.content]
            return {"role": role, "content": "".join(pieces)}
        parts = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in self.content
        ]
        return {"role": role, "content": parts}


# a function's name, as OpenAI allows it
FunctionNameText = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionDef(Tolerant):
    name: FunctionNameText
    description: str | None = None
    parameters: Any = (
        None  # a JSON schema (checked in router/completions/tools.py); None: no arguments
    )
    strict: bool | None = None


class Tool(Tolerant):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Tolerant):
    name: str


class NamedToolChoice(Tolerant):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # tool calling (router/completions/tools.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(Tolerant):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Tolerant):
    model: str | None = None
    tokens: list[int]


class WorkerChange(Strict):
    role: Literal["prefill", "decode", "encode"]
    address: str
