"""The body of `POST /v1/responses` (OpenAI's Responses API), validated at the edge as the
chat bodies are (completions/protocol.py): known fields strictly typed, unknown ones ignored.

Input items are read loosely typed here and checked one by one where they become chat
messages (convert.py), so that an item the router cannot take is refused naming
`input.N` and saying why, not with a union's list of every shape it failed to match.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from router.completions.protocol import FunctionNameText, StructuredOutputs, Tolerant
from services.engine.params import MAX_LOGPROBS, PENALTY_LIMIT


class ContentPart(Tolerant):
    """A part of a message's content: `input_text`, `output_text`, `refusal` (text),
    `input_image` (a model that reads images: `image_url`, a data: URL or one the operator
    allows); a file or audio part is refused."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image
    detail: str | None = None  # input_image: auto, low or high
    file_id: str | None = None  # input_image by an uploaded file: refused (no Files API)


class InputItem(Tolerant):
    """One item of `input`: a message (`type` "message" or absent, with a `role`), a
    `function_call` an earlier turn made, a `function_call_output` answering one, or a
    `reasoning` item (skipped: the served models do not take one back)."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output
    id: str | None = None


class FunctionTool(Tolerant):
    """A tool as the Responses API declares a function: flat, no `function` wrapper. Tools of
    other types (web search, file search, MCP...) are refused: the router runs none."""

    type: str
    name: FunctionNameText | None = None
    description: str | None = None
    parameters: Any = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolChoiceFunction(Tolerant):
    type: Literal["function"]
    name: str


class TextFormat(Tolerant):
    """`text.format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Tolerant):
    format: TextFormat | None = None


class ResponsesRequest(Tolerant):
    model: str | None = None  # optional, as in vLLM: the one served model
    input: str | list[InputItem]
    instructions: str | None = None  # a system message first (not carried to follow-ups)
    previous_response_id: str | None = None  # continue a stored response's conversation
    store: bool = True
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None  # returned with the response, changes nothing
    # not served: refused when asked for, rather than ignored (the answer would differ)
    background: bool = False
    conversation: Any = None
    # vLLM's extra sampling fields, as in chat completions
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    structured_outputs: StructuredOutputs | None = None  # also how JSON is written (whitespace)
