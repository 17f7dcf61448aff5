"""A request's body as the endpoints read it: strict JSON into a pydantic model, or the 4xx
a client would expect (413 past the size limit; 400 for malformed JSON, a lone surrogate, or
a field that does not validate, naming the field as the body does)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from router.errors import APIError, bad_request

M = TypeVar("M", bound=pydantic.BaseModel)


async def read_model(request: Request, model: type[M], limit: int) -> M:
    """The JSON body as `model`, or the 4xx a client would expect."""
    body = await request.body()
    if len(body) > limit:
        raise APIError(
            413, f"request body of {len(body)} bytes exceeds {limit}", None, "request_too_large"
        )
    try:
        data: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON: {e}") from e
    except RecursionError as e:
        raise bad_request("malformed JSON: nested too deeply") from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    if SURROGATE_ESCAPE.search(body):  # escapes may pair up into real characters: look
        check_no_lone_surrogates(data, "")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        first = telling_error(e.errors())
        param = ".".join(error_path(first["loc"])) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from e


def error_path(loc: Sequence[Any]) -> list[str]:
    """A pydantic location as the body names it: no union branch types (`list[...]`), a
    tagged union's tag not repeated before the field it tags."""
    out: list[str] = []
    for part in map(str, loc):
        if "[" not in part and (not out or out[-1] != part):
            out.append(part)
    return out


def telling_error(errors: list[Any]) -> Any:
    """The error to report: the first, or where it is one branch of a union (a message's
    content: a string or parts), the deepest of that field's (the part that is wrong)."""
    first = errors[0]
    loc = tuple(first["loc"])
    if not loc or loc[-1] != "str":
        return first
    same = [e for e in errors if tuple(e["loc"])[: len(loc) - 1] == loc[:-1]]
    return max(same, key=lambda e: len(e["loc"]))


# A UTF-16 surrogate can only enter a str through a JSON escape (the body is strict UTF-8).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def check_no_lone_surrogates(data: Any, where: str) -> None:
    """400 naming the field of the first string holding half a surrogate pair (it cannot be
    encoded, tokenized or sent back as UTF-8)."""
    stack = [(data, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"{path or 'body'}: a lone UTF-16 surrogate (\\u{ord(value[e.start]):04x}) "
                    "is not text",
                    path or None,
                ) from e
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value))
