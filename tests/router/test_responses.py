"""The Responses API through the router and 2 + 2 worker processes, spoken to with the
official openai SDK: an answer is the chat answer to the same conversation, a stream's events
come in OpenAI's order and rebuild the whole answer, a forced function call comes back as a
call (cut or not) and a follow-up through previous_response_id continues the conversation,
stored responses belong to the key that made them, structured output parses into nested
pydantic models, and bad bodies are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.cluster import MODEL

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
ASK = "What is the weather in Paris?"


def other_key(client: openai.OpenAI) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url), api_key="another", max_retries=0)


def test_an_answer_is_the_chat_answer_to_the_same_conversation(client):
    r = client.responses.create(
        model=MODEL, input=ASK, instructions="Be brief.", temperature=0, max_output_tokens=24
    )
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
    )
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == message.status == expected and r.object == "response"
    assert r.id.startswith("resp_") and r.model == MODEL
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
        chat.usage.total_tokens,
    )


def test_a_stream_comes_in_order_and_rebuilds_the_whole_answer(client):
    args = dict(model=MODEL, input=ASK, temperature=0, max_output_tokens=20)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage and whole.usage
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert events[-2].item.content[0].text == text
    with client.responses.stream(**args) as stream:  # the SDK's helper takes the same stream
        assert stream.get_final_response().output_text == whole.output_text


def test_a_forced_call_then_its_output_continued_by_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],
        temperature=0,
        tool_choice="required",
        max_output_tokens=60,
    )
    (call,) = first.output
    assert first.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert set(arguments) == {"city"}  # strict: no property the schema does not name
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=30,
    )
    assert follow.previous_response_id == first.id and follow.output_text
    # the same conversation sent whole to chat completions gets the same answer
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=30,
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": function}],
    )
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage is not None and follow.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_call_cut_by_max_output_tokens_is_still_a_call(client):
    args = dict(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    full = client.responses.create(**args, max_output_tokens=60).output[0].arguments
    events = list(client.responses.create(**args, max_output_tokens=4, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    (call,) = final.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert call.arguments == done.arguments == "".join(pieces) and full.startswith(call.arguments)
    assert len(pieces) >= 2


def test_stored_responses_belong_to_their_key_and_store_false_keeps_none(client):
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    stranger = other_key(client)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError) as refused:
        stranger.responses.create(model=MODEL, previous_response_id=kept.id, input="and?")
    assert refused.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=50_000_000)


class Trip(BaseModel):
    cities: list[City] = Field(min_length=1, max_length=2)
    days: int = Field(ge=1, le=30)


def test_text_format_parses_into_nested_pydantic_models(client):
    r = client.responses.parse(
        model=MODEL,
        input="Plan a trip to two cities in France.",
        text_format=Trip,
        temperature=0,
        max_output_tokens=150,
    )
    assert r.status == "completed" and isinstance(r.output_parsed, Trip)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {
                "input": "hi",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "objec"}}],
            },
            "tools.0.parameters",
        ),
        (  # the embedded model reads text: an image is refused where it is
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.image_url",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": "hi", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": []}, "input"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
        ({"input": "hi", "background": True}, "background"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(router, body, param):
    r = httpx.post(f"{router.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == (
        "invalid_request_error"
    )
