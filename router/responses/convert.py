"""A Responses request as the chat request it means: its input items as chat messages, its
flat function tools, `text.format` as a `response_format`. The chat path (api.prepare_chat)
then runs it, tools and grammars and all, exactly as it runs /v1/chat/completions.

    message {role, content}               ->  a message of that role (parts joined)
    function_call {call_id, name, ...}    ->  a call on the assistant message before it
                                              (a new assistant message if none)
    function_call_output {call_id, ...}   ->  a tool message answering that call
    reasoning                             ->  nothing (the models do not take it back)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from router.completions.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    FunctionName,
    ImagePart,
    ImageUrl,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)
from router.errors import APIError, bad_request
from router.responses.protocol import ContentPart, FunctionTool, InputItem, ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_file", "input_audio")  # input_image: content_parts
# fields passed to the chat request as they are, when given
SAME_FIELDS = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "structured_outputs", "user")  # fmt: skip


def chat_request(
    req: ResponsesRequest, conversation: Sequence[ChatMessage]
) -> ChatCompletionRequest:
    """The chat request: `instructions` as a system message, then the conversation."""
    first = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    fields: dict[str, Any] = {
        "messages": [*first, *conversation],
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
        **{name: v for name in SAME_FIELDS if (v := getattr(req, name)) is not None},
    }
    if req.max_output_tokens is not None:
        fields["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs is not None:
        fields |= {"logprobs": True, "top_logprobs": req.top_logprobs}
    if req.tools:
        fields["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    if isinstance(req.tool_choice, str):
        fields["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        name = FunctionName(name=req.tool_choice.name)
        fields["tool_choice"] = NamedToolChoice(type="function", function=name)
    response_format = text_format(req)
    if response_format is not None:
        fields["response_format"] = response_format
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as e:  # the same constraints were checked at the edge
        raise bad_request(str(e.errors()[0]["msg"])) from e


def chat_tool(i: int, tool: FunctionTool) -> Tool:
    if tool.type != "function":
        raise bad_request(
            f"tools.{i}: tools of type {tool.type!r} are not supported; the server runs "
            "function tools (the client runs them and sends their output back)",
            f"tools.{i}.type",
        )
    if tool.name is None:
        raise bad_request(f"tools.{i}: a function tool needs a name", f"tools.{i}.name")
    function = FunctionDef(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )
    return Tool(type="function", function=function)


def text_format(req: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (None: free text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format: json_schema needs its schema", "text.format.schema")
    spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
            "strict": fmt.strict}  # fmt: skip
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": spec})


# chat's names for what the Responses body calls otherwise (the longest first)
RESPONSES_NAMES = [
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
]


def flat_param(error: APIError) -> APIError:
    """A chat error's field named as the Responses body names it: tools.0.parameters (not
    tools.0.function.parameters), input (not messages), text.format (not response_format)."""
    param = error.param
    if param is None:
        return error
    named = param.replace(".function.", ".")
    for chat, responses in RESPONSES_NAMES:
        if named == chat or named.startswith(chat + "."):
            named = responses + named[len(chat) :]
            break
    error.message = error.message.replace(param, named)
    error.param = named
    return error


# -- input items ----------------------------------------------------------------------


def input_messages(items: str | Sequence[InputItem], where: str = "input") -> list[ChatMessage]:
    """The items as chat messages, in order; 400 naming the first item that cannot be one."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role is None:
                raise bad_request(f"{at}: a message needs a role", f"{at}.role")
            out.append(ChatMessage(role=item.role, content=content_parts(item.content, at)))
        elif kind == "function_call":
            add_call(out, function_call(item, at))
        elif kind == "function_call_output":
            if item.call_id is None:
                raise bad_request(f"{at}: a function_call_output needs its call_id", at)
            output = content_text(item.output, at)
            out.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise bad_request(
                f"{at}: item references are not supported; send the item itself, "
                "or continue with previous_response_id",
                f"{at}.type",
            )
        else:
            raise bad_request(
                f"{at}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output)",
                f"{at}.type",
            )
    return out


def output_messages(output: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """A response's output items as the messages a follow-up continues from."""
    return input_messages([InputItem.model_validate(item) for item in output], "output")


def function_call(item: InputItem, at: str) -> ToolCall:
    if item.call_id is None or item.name is None:
        raise bad_request(f"{at}: a function_call needs its call_id and name", at)
    function = FunctionCall(name=item.name, arguments=item.arguments or "{}")
    return ToolCall(id=item.call_id, function=function)


def add_call(messages: list[ChatMessage], call: ToolCall) -> None:
    """A call joins the assistant message just before it (its text, or calls made with it)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def content_parts(
    content: str | list[ContentPart] | None, at: str
) -> str | list[TextPart | ImagePart]:
    """A message's content as chat's: its text, or with images its parts in order."""
    if not isinstance(content, list) or not any(p.type == "input_image" for p in content):
        return content_text(content, at)
    out: list[TextPart | ImagePart] = []
    for k, part in enumerate(content):
        where = f"{at}.content.{k}"
        if part.type != "input_image":
            out.append(TextPart(type="text", text=content_text([part], at)))
            continue
        if part.image_url is None:
            why = "images by file_id are not supported" if part.file_id else "no image_url"
            raise bad_request(f"{where}: {why}; send image_url", f"{where}.image_url")
        detail = part.detail or "auto"
        if detail not in ("auto", "low", "high"):
            raise bad_request(f"{where}: detail {detail!r} (auto, low or high)", f"{where}.detail")
        url = ImageUrl(url=part.image_url, detail=detail)  # type: ignore[arg-type]
        out.append(ImagePart(type="image_url", image_url=url))
    return out


def content_text(content: str | list[ContentPart] | None, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type in TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.type in MEDIA_PARTS:
            raise bad_request(
                f"{at}.content.{k}: {part.type} parts are not supported",
                f"{at}.content.{k}.type",
            )
        else:
            raise bad_request(
                f"{at}.content.{k}: unknown content part {part.type!r}", f"{at}.content.{k}.type"
            )
    return "".join(texts)
