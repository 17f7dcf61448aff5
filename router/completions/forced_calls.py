"""Forced tool calls (`tool_choice` "required" or a named function): the grammar lets the
model write the calls and nothing else, no tags or wrapper text, so no token goes to them and
a call cut by `max_tokens` is still a call (its arguments as far as generated), as vLLM does.

    a named function:  its arguments, one JSON object          {"city": "Paris"}
    "required":        a call                {"name": "get_weather", "arguments": {...}}
    with parallel_tool_calls, an array of them                 [{"name": ...}, {"name": ...}]

(An array's "]" is a token the model writes when it is done, as it writes "</tool_call>"
after a tagged call; calls one a line would give it no such token, and it writes call after
call until max_tokens.)
`ForcedCalls` reads the output as it arrives into OpenAI's tool-call deltas: a call's id and
name as soon as they are known, then its arguments as they grow.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from router.completions.protocol import Tool
from router.completions.structured import JsonStyle, compile_grammar, schema_text, strict_schema
from router.errors import bad_request


@dataclass(frozen=True)
class Forced:
    name: str | None  # the function named by tool_choice; None: "required" (any of the tools)
    parallel: bool  # "required": several calls allowed


NO_ARGUMENTS = {"type": "object", "properties": {}}


def parameters(tool: Tool) -> Any:
    return NO_ARGUMENTS if tool.function.parameters is None else tool.function.parameters


def grammar(tools: list[Tool], forced: Forced, style: JsonStyle) -> str:
    """The grammar of the forced output (each schema was compiled alone before)."""
    if forced.name is not None:
        tool = next(t for t in tools if t.function.name == forced.name)
        spec, kind = schema_text(parameters(tool), "tool_choice", style.strict), "json"
    else:
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "arguments": strict_schema(parameters(t))
                        if style.strict
                        else parameters(t),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ],
            "x-guidance": style.options,
        }
        if forced.parallel:  # a JSON array of calls: its "]" is the model's to write
            del call["x-guidance"]
            listed = {"type": "array", "items": call, "minItems": 1}
            spec, kind = json.dumps(listed), "json"
        else:
            spec, kind = f"start: call\ncall: %json {json.dumps(call)}", "grammar"
    compiled, error = compile_grammar(kind, spec, style.compact)
    if error:
        raise bad_request(f"tools: {error.strip()}", "tools")
    return compiled


HEAD = re.compile(r'[\s\[,]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass
class ForcedCalls:
    """One choice's forced output read as it arrives. `deltas(text)` gives OpenAI's
    `delta.tool_calls` entries the text completes: a call's head (index, id, type, name),
    then pieces of its arguments."""

    forced: Forced
    new_id: Any  # () -> a call id
    calls: list[Call] = field(default_factory=list)
    buffer: str = ""
    open: bool = False  # the last call's arguments still growing
    closing: bool = False  # its arguments ended, its object's "}" not read yet
    depth: int = 0  # the arguments' nesting: {[ ... ]}
    in_string: bool = False
    escaped: bool = False

    def deltas(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.forced.name is not None:  # the whole output is the one call's arguments
            if not self.calls:
                out.append(self._start(self.forced.name))
            if text:
                out.append(self._grow(text))
            return out
        self.buffer += text
        while self.buffer:
            if self.closing:
                rest = self.buffer.lstrip()
                if not rest:
                    break
                self.buffer, self.closing = rest[1:] if rest[0] == "}" else rest, False
            elif not self.open:
                head = HEAD.match(self.buffer)
                if head is None:
                    break  # the head is not complete yet (or the output ends before it)
                self.buffer = self.buffer[head.end() :]
                out.append(self._start(json.loads(f'"{head.group(1)}"')))
                self.open, self.depth = True, 0
            else:
                if not self.calls[-1].arguments:  # the value's start, after any whitespace
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        break
                end = self._scan()
                piece, self.buffer = self.buffer[:end], self.buffer[end:]
                if piece:
                    out.append(self._grow(piece))
                if self.open:
                    break
        return out

    def _scan(self) -> int:
        """How much of the buffer belongs to the open call's arguments (closing it where
        they end)."""
        for i, ch in enumerate(self.buffer):
            if self.in_string:
                self.escaped, self.in_string = (
                    (False, True) if self.escaped else (ch == "\\", ch != '"')
                )
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.open, self.closing = False, True
                    return i + 1
        return len(self.buffer)

    def _start(self, name: str) -> dict[str, Any]:
        self.calls.append(Call(self.new_id(), name))
        k = len(self.calls) - 1
        return {"index": k, "id": self.calls[k].id, "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip

    def _grow(self, piece: str) -> dict[str, Any]:
        self.calls[-1].arguments += piece
        return {"index": len(self.calls) - 1, "function": {"arguments": piece}}

    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.as_openai() for c in self.calls]
