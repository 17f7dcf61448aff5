"""Structured output at the edge: a request's `response_format` (OpenAI), `structured_outputs`
or `guided_*` (vLLM) as one grammar in llguidance's text, which the workers' samplers enforce
(services/engine/structured.py), or a 400 naming the parameter at fault.

JSON schemas are strict by default, as vLLM's xgrammar: an object that names its properties
gets no others unless it says `additionalProperties`, a tuple (`prefixItems`) no more items
unless it says `items`. Whitespace between JSON tokens is the model's to choose (it writes
`{"a": 1}` as its training has it: forcing `{"a":1}` derails small models), in runs of at most
WHITESPACE_RUN characters, so that a model cannot spend its budget on spaces.
`structured_outputs` `disable_any_whitespace` (compact JSON) and
`disable_additional_properties: false` (unnamed properties allowed) change either, for the
request's response_format and tools too. The grammars made from one schema are cached.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from router.completions.protocol import SamplingFields
from router.errors import bad_request
from services.engine.grammar_text import check_grammar

Matcher = llguidance.LLMatcher
ANY_OBJECT = '{"type": "object"}'
WHITESPACE_RUN = 20  # characters of whitespace between two JSON tokens, at most
COMPACT: Any = {"whitespace_flexible": False}
FLEXIBLE: Any = {
    "whitespace_flexible": True,
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{WHITESPACE_RUN}}}",
}


@dataclass(frozen=True)
class JsonStyle:
    strict: bool = True  # no properties (or tuple items) a schema does not name
    compact: bool = False  # no whitespace between tokens

    @property
    def options(self) -> Any:
        return COMPACT if self.compact else FLEXIBLE


def json_style(req: SamplingFields) -> JsonStyle:
    so = req.structured_outputs
    if so is None:
        return JsonStyle()
    return JsonStyle(
        strict=so.disable_additional_properties is not False,
        compact=bool(so.disable_any_whitespace),
    )


def grammar_of(req: SamplingFields) -> str | None:
    """The request's grammar; None when its output is free."""
    forms = [(param, kind, spec) for param, kind, spec in _forms(req) if spec is not None]
    if len(forms) > 1:
        names = ", ".join(param for param, _, _ in forms)
        raise bad_request(f"give one structured output form, not several ({names})", forms[1][0])
    if not forms:
        return None
    param, kind, spec = forms[0]
    style = json_style(req)
    if kind == "json":
        spec = schema_text(spec, param, style.strict)
    elif kind == "choice":
        spec = choice_text(spec, param)
    elif not isinstance(spec, str) or not spec:
        raise bad_request(f"{param}: must be a non-empty string", param)
    grammar, error = compile_grammar(kind, spec, style.compact)
    if error:
        raise bad_request(f"{param}: {error.strip()}", param)
    return grammar


def _forms(req: SamplingFields) -> list[tuple[str, str, Any]]:
    """(param, kind, spec) of every way the request can ask for structure."""
    forms: list[tuple[str, str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        forms.append(("response_format", "json", ANY_OBJECT))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(
                "response_format: type json_schema needs json_schema.schema",
                "response_format.json_schema",
            )
        forms.append(("response_format.json_schema.schema", "json", fmt.json_schema.json_schema))
    so = req.structured_outputs
    if so is not None:
        forms += [
            ("structured_outputs.json", "json", so.json_),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "grammar", so.grammar),
            ("structured_outputs.json_object", "json", ANY_OBJECT if so.json_object else None),
        ]
    forms += [
        ("guided_json", "json", req.guided_json),
        ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice),
        ("guided_grammar", "grammar", req.guided_grammar),
    ]
    return forms


def schema_text(spec: Any, param: str, strict: bool = True) -> str:
    """A JSON schema (an object, or its JSON text) as text, its keys in the order given (the
    order properties are generated in), made strict (`strict_schema`): the cache's key."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param}: not valid JSON: {e}", param) from e
    if not isinstance(spec, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(strict_schema(spec) if strict else spec)


SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict_schema(schema: Any, close: bool = True) -> Any:
    """The schema with `additionalProperties: false` on each object that names properties
    and says nothing of others, `items: false` on each tuple that says nothing of more items
    (a copy; everything else as given). The parts of an `allOf` are not closed themselves
    (each would refuse the others' properties), their insides are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMAS:
        if key in out:
            out[key] = strict_schema(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s, close=key != "allOf") for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(s) for k, s in out[key].items()}
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if close and "properties" in out and not any(k in out for k in others):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


def choice_text(spec: Any, param: str) -> str:
    if not spec or not all(isinstance(c, str) and c for c in spec):
        raise bad_request(f"{param}: must be a non-empty list of non-empty strings", param)
    return json.dumps(spec)


@lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str, compact: bool = False) -> tuple[str, str]:
    """(grammar, error) for a spec of a kind; error is '' when the grammar is valid. `compact`:
    JSON without whitespace between tokens."""
    try:
        if kind == "json":
            options = JsonStyle(compact=compact).options
            grammar = Matcher.grammar_from_json_schema(spec, defaults=options)
        elif kind == "regex":
            grammar = Matcher.grammar_from_regex(spec)
        elif kind == "choice":  # Lark string literals take JSON's escapes
            grammar = Matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
            )
        else:  # a Lark grammar, or GBNF (llama.cpp's and vLLM's EBNF) converted to Lark
            grammar = Matcher.grammar_from_lark(any_to_lark(spec))
    except Exception as e:  # the converters raise ValueError and friends on bad input
        return "", str(e) or type(e).__name__
    return grammar, check_grammar(grammar)
