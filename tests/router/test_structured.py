"""Structured output through the router and 2 + 2 worker processes, with the official client:
`beta.chat.completions.parse` on 20 schemas at temperature 0.8 (every raw output validated
with jsonschema), vLLM's regex / choice / json_object forms and their older guided_* names,
a stream equal to the whole answer, bad grammars refused with nothing queued, and unknown
fields ignored."""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.cluster import MODEL, load, wait_idle

Short = Annotated[str, Field(max_length=24)]
# numbers in steps (multipleOf): a free fraction lets a 135M model ramble digits to max_tokens
Score = Annotated[float, Field(ge=0, le=10, multiple_of=0.5)]
Small = Annotated[int, Field(ge=-5, le=5)]


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Address(BaseModel):
    city: Short
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class WithAddress(BaseModel):
    person: Person
    address: Address


class Tags(BaseModel):
    tags: Annotated[list[Short], Field(min_length=1, max_length=3)]


class Paint(BaseModel):
    color: Color
    coats: Small


class Review(BaseModel):
    title: Short
    score: Score
    recommended: bool


class MaybeNick(BaseModel):
    name: Short
    nickname: Short | None


class Point(BaseModel):
    x: Small
    y: Small


class Polygon(BaseModel):  # $defs / $ref: Point is a definition referenced three times
    corners: Annotated[list[Point], Field(min_length=3, max_length=3)]


class Item(BaseModel):
    sku: Annotated[str, Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")]
    qty: Annotated[int, Field(ge=1, le=9)]


class Order(BaseModel):  # $defs / $ref again, in an array and beside it
    first: Item
    rest: Annotated[list[Item], Field(max_length=2)]


class Status(BaseModel):
    state: Literal["open", "closed", "pending"]
    priority: Annotated[int, Field(ge=1, le=3)]


class Pair(BaseModel):
    left: Annotated[list[Small], Field(min_length=2, max_length=2)]
    right: Annotated[list[Small], Field(min_length=2, max_length=2)]


class Team(BaseModel):
    lead: Person
    members: Annotated[list[Person], Field(min_length=1, max_length=2)]


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: Annotated[float, Field(ge=0, le=1, multiple_of=0.25)]


class Measure(BaseModel):
    value: Annotated[float, Field(ge=-100, le=100, multiple_of=0.1)]
    unit: Literal["cm", "kg", "s"]


class Flags(BaseModel):
    a: bool
    b: bool
    c: bool | None


class Book(BaseModel):
    title: Short
    authors: Annotated[list[Short], Field(min_length=1, max_length=2)]
    year: Annotated[int, Field(ge=1450, le=2030)]


class Palette(BaseModel):
    primary: Color
    others: Annotated[list[Color], Field(max_length=2)]


class Coord(BaseModel):
    lat: Annotated[float, Field(ge=-90, le=90, multiple_of=0.5)]
    lon: Annotated[float, Field(ge=-180, le=180, multiple_of=0.5)]
    label: Short | None


class Event(BaseModel):
    where: Coord
    status: Status
    reviews: Annotated[list[Review], Field(max_length=1)]


SCHEMAS = [Person, WithAddress, Tags, Paint, Review, MaybeNick, Polygon, Order, Status, Pair,
           Team, Answer, Measure, Flags, Book, Palette, Coord, Event, Point, Address]  # fmt: skip


def test_parse_twenty_schemas_at_temperature(router):
    """Each schema's parsed object, and its raw text valid under the schema the client sent."""
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)

    async def one(k: int, model: type[BaseModel]) -> None:
        r = await client.beta.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me an example {model.__name__}."}],
            response_format=model,
            temperature=0.8,
            seed=k,
            max_tokens=400,
        )
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, model)
        schema = openai.lib._pydantic.to_strict_json_schema(model)
        jsonschema.validate(json.loads(message.content), schema)

    async def run() -> None:
        await asyncio.gather(*(one(k, m) for k, m in enumerate(SCHEMAS)))

    assert len({m.__name__ for m in SCHEMAS}) == 20
    asyncio.run(run())


def chat(
    router, body: dict, path: str = "chat/completions", ask: str = "What colour is the sky?"
) -> httpx.Response:
    base = {"model": MODEL, "temperature": 0, "max_tokens": 60}
    if path == "chat/completions":
        base["messages"] = [{"role": "user", "content": ask}]
    else:
        base["prompt"] = f"Question: {ask}\nAnswer:"
    return httpx.post(f"{router.url}/v1/{path}", json={**base, **body}, timeout=60)


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_regex_choice_and_json_object_in_every_spelling(router, path):
    def text(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]

    date = r"\d{4}-\d{2}-\d{2}"
    for body in ({"structured_outputs": {"regex": date}}, {"guided_regex": date}):
        assert re.fullmatch(date, text(chat(router, body, path)))
    choices = ["blue", "grey", 'it depends "quoted"']
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        assert text(chat(router, body, path)) in choices
    for body in (
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True}},
        {
            "guided_json": {
                "type": "object",
                "properties": {"k": {"enum": [1, 2]}},
                "required": ["k"],
                "additionalProperties": False,
            }
        },
        {
            "structured_outputs": {
                # bounded: an unbounded integer lets this model write digits to max_tokens
                "json": '{"type": "array", "maxItems": 2, "items": {"type": "integer", '
                '"minimum": 0, "maximum": 150}}'
            }
        },
    ):
        body["max_tokens"] = 200
        ask = "Reply in JSON: the name and age of a famous scientist."
        assert isinstance(json.loads(text(chat(router, body, path, ask))), (dict, list))
    lark = 'start: "The sky is " COLOR "."\nCOLOR: "blue" | "red"'
    gbnf = 'root ::= "The sky is " color "."\ncolor ::= "blue" | "red"'
    for body in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": gbnf}):
        assert text(chat(router, body, path)) in ("The sky is blue.", "The sky is red.")
    assert text(chat(router, {"response_format": {"type": "text"}}, path))  # no constraint


def test_cut_by_max_tokens_is_length(router):
    story = {"type": "string", "minLength": 40}
    schema = {"type": "object", "properties": {"story": story}, "required": ["story"]}
    r = chat(router, {"guided_json": schema, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    content = r.json()["choices"][0]["message"]["content"]
    assert "".join(content.split()).startswith('{"story"')  # whitespace is the model's


STRICT_PERSON = openai.lib._pydantic.to_strict_json_schema(Person)


def test_seeded_stream_equals_whole_with_n2(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "strict": True, "schema": STRICT_PERSON},
        },
        temperature=0.9,
        seed=7,
        n=2,
        max_tokens=120,
    )
    whole = client.chat.completions.create(**args)
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in whole.choices}
    for c in whole.choices:
        Person.model_validate_json(c.message.content)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": {"type": "frobnicated"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": ["not", "an object"]}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"$ref": "#/$defs/missing"}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),  # two forms
    ],
)
def test_bad_grammars_are_400_naming_the_param_and_queue_nothing(router, pool, body, param):
    r = chat(router, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param + "."), error
    assert param.split(".")[0] in error["message"] or error["param"] != param
    prefill, decode = pool
    assert all(load(w).running == 0 and load(w).waiting == 0 for w in (*prefill, *decode))
    assert chat(router, {"max_tokens": 2}).status_code == 200  # the next one is served


def test_unknown_fields_are_ignored(router, pool):
    """Unknown top-level and per-message fields: 200, the same text as without them."""
    plain = chat(router, {"max_tokens": 12})
    extra = {
        "service_tier": "auto",
        "metadata": {"k": "v"},
        "store": False,
        "messages": [
            {"role": "user", "content": "What colour is the sky?", "refusal": None, "audio": None}
        ],
        "stream_options": None,
        "some_future_field": {"nested": [1, 2]},
    }
    r = chat(router, {"max_tokens": 12, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    wait_idle([*pool[0], *pool[1]], 5)
