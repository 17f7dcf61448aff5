"""Tool calling: the tools into the prompt, `tool_choice` enforced with a grammar, and the
output parsed into OpenAI's `tool_calls`, whole or streamed.

The format is Hermes-style (what Qwen, Hermes and SmolLM-family fine-tunes emit):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template has a tools section gets `tools=` through its template; any other
gets the tools in a system message (TOOLS_PROMPT). `tool_choice` "required" or a named
function constrains the output to the calls alone, no tags (forced_calls.py: one call, or
several with `parallel_tool_calls`), whose arguments follow each function's `parameters`
schema, so they always parse and validate and always come back as calls; "auto" leaves the
model free and parses the <tool_call> blocks it wrote (a block that is not a valid call stays
in the text); "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.completions.forced_calls import Forced, parameters
from router.completions.forced_calls import grammar as forced_grammar
from router.completions.protocol import ChatCompletionRequest, ChatMessage, Tool
from router.completions.structured import compile_grammar, json_style, schema_text
from router.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions "
    "are listed in <tools></tools>, one JSON object each:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-as-a-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools change: the prompt's tools, the grammar forcing calls."""

    tools: list[Tool]  # those offered in the prompt (none for tool_choice "none")
    grammar: str | None  # "required" or a named function (forced_calls.py); None: free
    forced: Forced | None = None


def plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's tools checked (400 naming the param), and what they change."""
    tools, style = req.tools or [], json_style(req)
    for i, tool in enumerate(tools):
        spec = schema_text(parameters(tool), param(i), style.strict)
        _, error = compile_grammar("json", spec, style.compact)
        if error:
            raise bad_request(f"{param(i)}: not a usable JSON schema: {error.strip()}", param(i))
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "none":
        return ToolPlan([], None)
    if choice == "auto":
        return ToolPlan(tools, None)
    forced = tools
    if not isinstance(choice, str):
        forced = [t for t in tools if t.function.name == choice.function.name]
        if not forced:
            names = ", ".join(t.function.name for t in tools)
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({names})",
                "tool_choice",
            )
    how = Forced(
        None if isinstance(choice, str) else choice.function.name, bool(req.parallel_tool_calls)
    )
    return ToolPlan(tools, forced_grammar(forced, how, style), how)


def param(i: int) -> str:
    return f"tools.{i}.function.parameters"


# -- the prompt ----------------------------------------------------------------------


def template_messages(
    messages: list[ChatMessage],
    tools: list[Tool],
    template_has_tools: bool,
    image_text: str | None = None,
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: earlier calls and their results in
    the Hermes format, and (templates without a tools section) the tools in a system message.
    `image_text`: what an image is in a template that reads no parts (ChatMessage)."""
    out = [render(m, template_has_tools, image_text) for m in messages]
    if tools and not template_has_tools:
        listed = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render(message: ChatMessage, structured: bool, image_text: str | None = None) -> dict[str, Any]:
    """One message; a template with a tools section gets tool_calls as fields, any other
    the calls and results written out."""
    out = message.as_template_input(image_text)
    calls = [
        {"name": c.function.name, "arguments": loads_or_text(c.function.arguments)}
        for c in message.tool_calls or []
    ]
    if structured:
        if calls:
            out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    if calls:
        blocks = [f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls]
        out["content"] = "\n".join([out["content"], *blocks] if out["content"] else blocks)
    if message.role == "tool":
        out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    return out


def loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# -- the output ----------------------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(block: str) -> dict[str, Any] | None:
    """A <tool_call> block's body as an OpenAI tool call, or None if it is not one."""
    try:
        body = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", {})
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": body["name"], "arguments": json.dumps(arguments)},
    }


@dataclass
class CallSplitter:
    """One choice's output split into text and tool calls as it arrives. Text that could be
    the start of a <tool_call> tag is held until it is known; whitespace next to calls is
    dropped, so the text streamed equals the whole answer's."""

    buffer: str = ""
    in_call: bool = False
    pending_space: str = ""  # whitespace held until more text follows it
    started: bool = False  # some text has been emitted
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; the text to show now and the calls completed by it."""
        self.buffer += text
        shown, done = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                block = self.buffer[:end]
                self.buffer = self.buffer[end + len(CLOSE) :]
                self.in_call = False
                call = parse_call(block)
                if call is None:
                    shown += self._text(f"{OPEN}{block}{CLOSE}")
                else:
                    done.append(call)
                    self.pending_space = ""
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                shown += self._text(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN) :]
                self.in_call = True
                continue
            keep = 0 if final else held_back(self.buffer)
            shown += self._text(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            break
        if final and self.in_call:  # an unclosed call: what it was, as text
            shown += self._text(OPEN + self.buffer)
            self.buffer, self.in_call = "", False
        self.calls += done
        return shown, done

    def _text(self, text: str) -> str:
        """Text to show, with whitespace held at the edges (shown once text follows it)."""
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.pending_space += text
            return ""
        out = self.pending_space + body
        self.pending_space = text[len(body) :]
        self.started = True
        return out


def held_back(text: str) -> int:
    """Length of the longest tail of `text` that begins the <tool_call> tag."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


def split_whole(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished answer's text (None if only calls) and its calls."""
    splitter = CallSplitter()
    shown, calls = splitter.feed(text, final=True)
    return (shown or None), calls
