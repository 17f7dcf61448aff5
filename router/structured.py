"""Structured output at the edge: a request's `response_format` (OpenAI), `structured_outputs`
or `guided_*` (vLLM) as one grammar in llguidance's text, which the workers' samplers enforce
(services/engine/structured.py), or a 400 naming the parameter at fault.

JSON comes out compact (no free whitespace: a small model given room for whitespace can spend
its whole budget on it); the grammars made from one schema are cached.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from router.errors import bad_request
from router.protocol import SamplingFields
from services.engine.grammar_text import check_grammar

Matcher = llguidance.LLMatcher
ANY_OBJECT = '{"type": "object"}'
JSON_OPTIONS: Any = {"whitespace_flexible": False}


def grammar_of(req: SamplingFields) -> str | None:
    """The request's grammar; None when its output is free."""
    forms = [(param, kind, spec) for param, kind, spec in _forms(req) if spec is not None]
    if len(forms) > 1:
        names = ", ".join(param for param, _, _ in forms)
        raise bad_request(f"give one structured output form, not several ({names})", forms[1][0])
    if not forms:
        return None
    param, kind, spec = forms[0]
    if kind == "json":
        spec = schema_text(spec, param)
    elif kind == "choice":
        spec = choice_text(spec, param)
    elif not isinstance(spec, str) or not spec:
        raise bad_request(f"{param}: must be a non-empty string", param)
    grammar, error = compile_grammar(kind, spec)
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


def schema_text(spec: Any, param: str) -> str:
    """A JSON schema (an object, or its JSON text) as text, its keys in the order given (the
    order properties are generated in): the cache's key."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param}: not valid JSON: {e}", param) from e
    if not isinstance(spec, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(spec)


def choice_text(spec: Any, param: str) -> str:
    if not spec or not all(isinstance(c, str) and c for c in spec):
        raise bad_request(f"{param}: must be a non-empty list of non-empty strings", param)
    return json.dumps(spec)


@lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> tuple[str, str]:
    """(grammar, error) for a spec of a kind; error is '' when the grammar is valid."""
    try:
        if kind == "json":
            grammar = Matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
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
