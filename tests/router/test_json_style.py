"""How JSON is generated (completions/structured.py): strict schemas (no property or tuple item a
schema does not name, unless it allows them), whitespace the model's to choose in bounded
runs, and both changed per request through `structured_outputs` (vLLM's
disable_any_whitespace and disable_additional_properties), checked on grammars the router
compiles, against texts tokenized by the embedded tokenizer."""

from __future__ import annotations

import llguidance
import pytest

from router.completions.protocol import ChatCompletionRequest
from router.completions.structured import WHITESPACE_RUN, grammar_of, strict_schema
from router.completions.tools import plan
from services.engine.structured import Grammars
from services.tokenizer.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_strict_schema_closes_what_names_its_parts():
    loose = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object"},  # names nothing: left free
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#/$defs/d"}]},
            "list": {"type": "array", "items": {"anyOf": [{"properties": {"c": {}}}, {}]}},
            "both": {"allOf": [{"properties": {"f": {"properties": {"g": {}}}}}]},
        },
        "$defs": {"d": {"properties": {"e": {}}}},
    }
    closed = {"additionalProperties": False}
    assert (
        strict_schema(loose)
        == {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "integer"}}} | closed,
                "free": {"type": "object"},
                "open": {"type": "object", "properties": {}, "additionalProperties": True},
                "pair": {
                    "type": "array",
                    "prefixItems": [{"type": "string"}, {"$ref": "#/$defs/d"}],
                    "items": False,
                },
                "list": {
                    "type": "array",
                    "items": {"anyOf": [{"properties": {"c": {}}} | closed, {}]},
                },
                "both": {"allOf": [{"properties": {"f": {"properties": {"g": {}}} | closed}}]},
            },
            "$defs": {"d": {"properties": {"e": {}}} | closed},
        }
        | closed
    )


@pytest.fixture(scope="module")
def accepts(embedded_dir):
    tokenizer = Tokenizer.from_dir(embedded_dir)
    grammars = Grammars(
        tokenizer,
        tokenizer.vocab_size,
        [tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]],
    )

    def check(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(grammars.lltokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.consume_tokens(ids) and m.is_accepting()

    return check


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_json_is_strict_and_spaced_as_the_model_likes_by_default(accepts):
    for body in (
        {"guided_json": CITY},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
    ):
        g = grammar_of(request(**body))
        assert accepts(g, '{"city": "Paris"}') and accepts(g, '{"city":"Paris"}')
        assert accepts(g, '{\n  "city": "Paris"\n}')
        assert not accepts(g, '{"city": "Paris", "country": "France"}')
        assert accepts(g, "{" + " " * WHITESPACE_RUN + '"city": "Paris"}')
        assert not accepts(g, "{" + " " * (WHITESPACE_RUN + 1) + '"city": "Paris"}')


def test_each_can_be_changed_per_request(accepts):
    so = {"json": CITY, "disable_any_whitespace": True}
    compact = grammar_of(request(structured_outputs=so))
    assert accepts(compact, '{"city":"Paris"}') and not accepts(compact, '{"city": "Paris"}')
    so = {"json": CITY, "disable_additional_properties": False}
    loose = grammar_of(request(structured_outputs=so))
    assert accepts(loose, '{"city": "Paris", "country": "France"}')


def test_tool_arguments_follow_the_same_rules(accepts):
    tool = {"type": "function", "function": {"name": "where", "parameters": CITY}}
    named = {"type": "function", "function": {"name": "where"}}
    strict = plan(request(tools=[tool], tool_choice=named)).grammar
    assert strict is not None and accepts(strict, '{"city": "Paris"}')
    assert not accepts(strict, '{"city": "Paris", "zip": 1}')
    so = {"disable_additional_properties": False, "disable_any_whitespace": True}
    loose = plan(request(tools=[tool], tool_choice=named, structured_outputs=so)).grammar
    assert loose is not None and accepts(loose, '{"city":"Paris","zip":1}')
    assert not accepts(loose, '{"city": "Paris"}')
    required = plan(request(tools=[tool], tool_choice="required")).grammar
    assert required is not None
    assert accepts(required, '[{"name": "where", "arguments": {"city": "Paris"}}]')
    assert not accepts(required, '[{"name": "where", "arguments": {"city": "P", "zip": 1}}]')
