"""Tool calling through the router and 2 + 2 worker processes: `required` and a named
function always give calls whose arguments validate, streamed calls reassemble into the
whole answer's, histories with calls and results are taken, LangChain's tools and structured
output work, and bad tools are refused naming the param. The splitting of text and calls is
also checked alone, split at every position of the stream."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from router.completions.tools import CallSplitter, split_whole
from tests.support.cluster import MODEL, load

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_with_valid_arguments(client, parallel):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=0.8,
            seed=seed,
            max_tokens=200,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=0.8,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=100,
    )
    calls = r.choices[0].message.tool_calls
    check_calls(calls)
    assert {c.function.name for c in calls} == {"get_time"}


def test_streamed_calls_reassemble_into_the_whole_answers(client):
    args = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.8,
        seed=5,
        max_tokens=200,
    )
    whole = client.chat.completions.create(**args).choices[0]
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                if d.id is not None:  # the first delta of a call names it
                    assert call["id"] == d.id and d.type == "function" and d.function.name
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
    assert finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def streamed_calls(stream) -> tuple[list[tuple[str, str]], list[str]]:
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in stream:
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finishes


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client, choice):
    """No tag costs a token (the grammar lets only the calls be written): cut anywhere, the
    answer is the calls so far, `finish_reason` "length", no content; streamed the same."""
    args = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        temperature=0,
        parallel_tool_calls=False,
    )
    full = client.chat.completions.create(**args, max_tokens=200).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    check_calls(full.message.tool_calls)
    (whole,) = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    for cut in (1, 4, 12):
        r = client.chat.completions.create(**args, max_tokens=cut).choices[0]
        assert r.finish_reason == "length" and r.message.content is None
        got = [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]
        assert len(got) <= 1 and (got or choice == "required")
        if got:
            assert got[0][0] == whole[0] and whole[1].startswith(got[0][1])
        if isinstance(choice, dict):  # the call from its first token; its arguments grow
            assert len(got) == 1 and (cut < 12 or len(got[0][1]) > 8)
        streamed = client.chat.completions.create(**args, max_tokens=cut, stream=True)
        assert streamed_calls(streamed) == (got, ["length"])


def test_a_forced_call_with_a_response_format_is_calls(client):
    """The format shapes a text answer; a forced answer is calls (OpenAI takes both, and the
    Agents SDK sends both for an agent with an output type)."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        response_format={"type": "json_object"},
        parallel_tool_calls=False,
        max_tokens=100,
    ).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    check_calls(r.message.tool_calls)


def test_arguments_hold_the_named_properties_alone(client):
    """A schema that does not say `additionalProperties` (strict by default, as vLLM's): the
    model invents no keys (it added `temperature` and `temperature_scale` before)."""
    loose = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"]}}}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[loose],
            tool_choice=named,
            temperature=0.8,
            seed=seed,
            max_tokens=60,
        ).choices[0]
        assert r.finish_reason == "tool_calls"
        assert set(json.loads(r.message.tool_calls[0].function.arguments)) == {"city"}


def test_a_history_with_calls_and_results_is_taken(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=30, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {
                        "type": "function",
                        "function": {
                            "name": "g",
                            "parameters": {"type": "object", "properties": {"x": {"type": "frob"}}},
                        },
                    },
                ]
            },
            "tools.1.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function"),
        (  # given with a forced call, the format is still checked
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                },
            },
            "response_format",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_param_and_queue_nothing(router, pool, body, param):
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param + "."), error
    assert all(load(w).running == 0 and load(w).waiting == 0 for w in (*pool[0], *pool[1]))


class Weather(BaseModel):
    """The weather somewhere."""

    city: str = Field(max_length=20)
    degrees: int = Field(ge=-50, le=50)


def test_langchain_tools_and_structured_output(router):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{router.url}/v1",
        api_key="x",
        model=MODEL,
        temperature=0.7,
        max_tokens=150,
        seed=1,
        max_retries=0,
    )
    weather = WEATHER["function"]
    message = llm.bind_tools([weather], tool_choice="any").invoke(ASK[0]["content"])
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], weather["parameters"])
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("Weather in Oslo?")
        assert isinstance(out, Weather), method


# -- the splitting alone --------------------------------------------------------------

CALL = '{"name": "f", "arguments": {"a": 1}}'
TEXTS = [
    f"<tool_call>\n{CALL}\n</tool_call>",
    f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
    "no calls here, only <tool text and a < sign",
    "<tool_call>\nnot json\n</tool_call> after",
    f"before <tool_call>\n{CALL}\n</tool_call> and after",
    "an unclosed <tool_call>\n{",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_splitting_equals_whole_at_every_split(text):
    content, calls = split_whole(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            s = CallSplitter()
            shown = ""
            for i, piece in enumerate(pieces):
                out, _ = s.feed(piece, final=i == len(pieces) - 1)
                shown += out
            assert (shown or None) == content
            assert [c["function"] for c in s.calls] == [c["function"] for c in calls]


def test_splitting_results():
    content, calls = split_whole(TEXTS[0])
    assert content is None and len(calls) == 1
    content, calls = split_whole(TEXTS[1])
    assert content == "Let me look." and len(calls) == 2
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert split_whole(TEXTS[2]) == (TEXTS[2], [])
    assert split_whole(TEXTS[3]) == (TEXTS[3], [])  # not a call: left as text
    assert split_whole(TEXTS[4])[0] == "before and after"
    assert split_whole(TEXTS[5]) == (TEXTS[5], [])
