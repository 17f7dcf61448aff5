"""The Responses API's parts alone: the store (bounds, expiry, tenants), input items as chat
messages, and the output builder, whose items are the same whether the text comes at once or
split at any point, and whose events rebuild those items."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.completions.forced_calls import Forced
from router.completions.protocol import ChatMessage
from router.errors import APIError
from router.responses.convert import chat_request, input_messages, output_messages
from router.responses.output import Output
from router.responses.protocol import ResponsesRequest
from router.responses.store import ResponseStore, Stored, tenant

# -- the store ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(text: str) -> Stored:
    return Stored({"id": text}, (ChatMessage(role="user", content=text),))


def test_the_store_keeps_the_newest_within_its_capacity():
    store, a = ResponseStore(capacity=3, ttl=60, clock=Clock()), tenant("key-a")
    for i in range(5):
        store.put(a, f"r{i}", stored(str(i)))
    assert len(store) == 3
    assert [store.get(a, f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]


def test_a_stored_response_expires_after_its_ttl():
    clock = Clock()
    store, a = ResponseStore(capacity=10, ttl=60, clock=clock), tenant("key-a")
    store.put(a, "old", stored("old"))
    clock.now = 30
    store.put(a, "new", stored("new"))
    clock.now = 59.9
    assert store.get(a, "old") is not None
    clock.now = 60
    assert store.get(a, "old") is None and store.get(a, "new") is not None
    clock.now = 90
    assert store.get(a, "new") is None and len(store) == 0


def test_one_tenant_never_reads_or_deletes_anothers():
    store, a, b = ResponseStore(clock=Clock()), tenant("key-a"), tenant("key-b")
    store.put(a, "r", stored("a's"))
    assert store.get(b, "r") is None and store.get(tenant(None), "r") is None
    assert not store.delete(b, "r") and store.get(a, "r") is not None
    assert store.delete(a, "r") and store.get(a, "r") is None


def test_capacity_zero_stores_nothing():
    store = ResponseStore(capacity=0, clock=Clock())
    store.put(tenant(None), "r", stored("x"))
    assert store.get(tenant(None), "r") is None


# -- input items ----------------------------------------------------------------------


def items(*raw: dict[str, Any]) -> list[Any]:
    return ResponsesRequest.model_validate({"input": list(raw)}).input  # type: ignore[return-value]


def test_items_become_the_chat_messages_they_mean():
    messages = input_messages(items(
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c": "P"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"c": "R"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    ))  # fmt: skip
    assert [(m.role, m.text) for m in messages] == [
        ("user", "Weather in Paris and Rome?"),
        ("assistant", "Let me look."),  # the calls join the message before them
        ("tool", "sunny"),
        ("tool", "rain"),
        ("developer", "Be brief."),
    ]
    calls = messages[1].tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("c1", "weather", '{"c": "P"}'),
        ("c2", "weather", '{"c": "R"}'),
    ]
    assert [m.tool_call_id for m in messages[2:4]] == ["c1", "c2"]


def test_a_call_with_no_message_before_it_gets_its_own():
    (message,) = input_messages(items({"type": "function_call", "call_id": "c", "name": "f"}))
    assert message.role == "assistant" and message.content is None
    assert message.tool_calls and message.tool_calls[0].function.arguments == "{}"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        (
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]},
            "input.0.content.0.image_url",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "x", "detail": "ultra"}],
            },
            "input.0.content.0.detail",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            "input.0.content.0.type",
        ),
        ({"role": "user", "content": [{"type": "sticker"}]}, "input.0.content.0.type"),
        ({"type": "message", "content": "no role"}, "input.0.role"),
        ({"type": "function_call", "name": "f"}, "input.0"),
        ({"type": "function_call_output", "output": "x"}, "input.0"),
        ({"type": "item_reference", "id": "msg_1"}, "input.0.type"),
        ({"type": "web_search_call"}, "input.0.type"),
    ],
)
def test_an_item_that_cannot_be_a_message_is_refused_by_its_place(item, param):
    with pytest.raises(APIError) as refused:
        input_messages(items(item))
    assert refused.value.status == 400 and refused.value.param == param


def test_the_chat_request_carries_the_instructions_tools_and_format():
    req = ResponsesRequest.model_validate({
        "input": "hi", "instructions": "Be kind.", "max_output_tokens": 9, "temperature": 0.5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "top_logprobs": 2, "seed": 7,
    })  # fmt: skip
    chat = chat_request(req, input_messages(req.input))
    assert [(m.role, m.text) for m in chat.messages] == [("system", "Be kind."), ("user", "hi")]
    assert chat.max_completion_tokens == 9 and chat.temperature == 0.5 and chat.seed == 7
    assert chat.tools and chat.tools[0].function.name == "f"
    assert not isinstance(chat.tool_choice, str) and chat.tool_choice is not None
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    assert chat.logprobs and chat.top_logprobs == 2


# -- the output -----------------------------------------------------------------------

CALL = '{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}'
CASES = [
    # (forced, with tools, text)
    (None, False, "Hello there, friend."),
    (None, True, f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>"),
    (None, True, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"),
    (Forced("f", False), True, '{"a": [1, {"b": "}"}]}'),
    (Forced(None, True), True, f"[{CALL}, {CALL}]"),
]


def rebuilt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as a client rebuilds them from the events."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(out)
            out.append(e["item"])
        elif e["type"] == "response.output_text.delta":
            out[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            out[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            done = dict(e["item"])
            assert {k: v for k, v in out[e["output_index"]].items() if k != "status"} == {
                k: v for k, v in done.items() if k != "status"
            }
            out[e["output_index"]] = done
    return out


def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def no_logprobs(entries: Any) -> list[dict[str, Any]]:
    return []


@pytest.mark.parametrize(("forced", "with_tools", "text"), CASES)
def test_items_are_the_same_fed_whole_or_split_anywhere(forced, with_tools, text):
    whole = Output(forced, with_tools, no_logprobs)
    whole.feed(text, [], "stop")
    assert all(item["status"] == "completed" for item in whole.items)
    for cut in range(len(text) + 1):
        split = Output(forced, with_tools, no_logprobs)
        events = split.feed(text[:cut], [], None) + split.feed(text[cut:], [], "stop")
        assert without_ids(split.items) == without_ids(whole.items), cut
        assert without_ids(rebuilt(events)) == without_ids(whole.items), cut


def test_calls_come_back_as_function_calls_with_their_arguments():
    out = Output(Forced(None, True), True, no_logprobs)
    out.feed(f"[{CALL}, {CALL}]", [], "stop")
    assert [(i["type"], i["name"], json.loads(i["arguments"])) for i in out.items] == [
        ("function_call", "f", {"a": [1, {"b": "}"}]})
    ] * 2
    assert all(i["call_id"].startswith("call_") and i["id"].startswith("fc_") for i in out.items)
    assert out.status == "completed"
    (message,) = output_messages(out.items)  # what a follow-up continues from
    assert message.role == "assistant" and message.tool_calls is not None
    assert [c.id for c in message.tool_calls] == [i["call_id"] for i in out.items]


def test_a_cut_answer_is_incomplete_with_its_text_so_far():
    out = Output(Forced("f", False), True, no_logprobs)
    events = out.feed('{"a": [1', [], "length")
    assert out.status == "incomplete"
    assert [(i["type"], i["arguments"], i["status"]) for i in out.items] == [
        ("function_call", '{"a": [1', "incomplete")
    ]
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]


# -- a stream that fails --------------------------------------------------------------


def test_a_stream_failing_midway_ends_with_response_failed():
    """A worker fault the router cannot hide (every decode worker gone past retry_wait)
    after the stream began: the events so far, then response.failed with the error."""
    import asyncio
    from types import SimpleNamespace

    from router.completions.openai_format import ChoiceState
    from router.completions.tools import ToolPlan
    from router.errors import unavailable
    from router.responses.api import Answer
    from router.responses.store import ResponseStore
    from router.workers.jobs import Delta
    from services.tracing import NO_SPAN

    async def run(jobs, admission, span):
        yield Delta(0, [1, 2], "Hello"), ChoiceState(0, "Hello", [1, 2])
        raise unavailable("no decode worker can serve the request")

    state = SimpleNamespace(run=run, model_id="m", responses=ResponseStore())
    chat = SimpleNamespace(tool_plan=ToolPlan([], None), top=None, ids=[5, 6, 7], jobs=[])
    req = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    answer = Answer(state, req, "resp_1", chat, tenant(None), ())  # type: ignore[arg-type]

    async def collect() -> list[dict[str, Any]]:
        out = []
        async for raw in answer.events(None, NO_SPAN):  # type: ignore[arg-type]
            kind, data = raw.decode().strip().split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            out.append(event)
        return out

    events = asyncio.run(collect())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "service_unavailable",
        "message": "no decode worker can serve the request",
    }
    assert state.responses.get(tenant(None), "resp_1") is None  # a failed response is not kept


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        ("tools.1.function.parameters", "tools.1.parameters"),
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("temperature", "temperature"),
    ],
)
def test_chat_errors_name_the_responses_field(chat, responses):
    from router.errors import bad_request
    from router.responses.convert import flat_param

    error = flat_param(bad_request(f"{chat}: wrong", chat))
    assert (error.param, error.message) == (responses, f"{responses}: wrong")
