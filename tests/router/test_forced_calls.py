"""Forced tool calls read from the output alone (completions/forced_calls.py): a named function's
arguments and "required"'s call objects, whole, cut anywhere (the arguments so far), and
streamed split at every position (the deltas reassemble into the whole reading)."""

from __future__ import annotations

import itertools

import pytest

from router.completions.forced_calls import Forced, ForcedCalls

NAMED = Forced("get_weather", parallel=False)
REQUIRED = Forced(None, parallel=True)
TWO = (
    '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}}, '
    '{"name":"get_time","arguments":{}}]'
)
ARGUMENTS = TWO.index('{"city')  # where the first call's arguments start


def read(forced: Forced, pieces: list[str]) -> list[dict]:
    ids = (f"call_{i}" for i in itertools.count())
    reader = ForcedCalls(forced, lambda: next(ids))
    calls: list[dict] = []
    for piece in pieces:
        for d in reader.deltas(piece):
            if "id" in d:
                assert d["index"] == len(calls)
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert calls == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in reader.tool_calls()
    ]
    return calls


def test_whole_outputs():
    assert read(NAMED, ['{"city": "Paris"}']) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    one = read(Forced(None, parallel=False), ['{"name":"get_time","arguments":{"zone":"JST"}}'])
    assert [(c["name"], c["arguments"]) for c in one] == [("get_time", '{"zone":"JST"}')]
    two = read(REQUIRED, [TWO])
    assert [(c["name"], c["arguments"]) for c in two] == [
        ("get_weather", '{"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}'),
        ("get_time", "{}"),
    ]


@pytest.mark.parametrize(
    "forced, text", [(NAMED, '{"city": "Paris", "unit": "celsius"}'), (REQUIRED, TWO)]
)
def test_streamed_at_every_split_equals_whole(forced, text):
    whole = read(forced, [text])
    for i in range(len(text) + 1):
        assert read(forced, [text[:i], text[i:]]) == whole
    assert read(forced, list(text)) == whole


def test_cut_outputs_keep_the_calls_so_far():
    """max_tokens anywhere: a named call is there from the first token; a "required" call
    once its name is complete, its arguments as far as written."""
    assert read(NAMED, [""]) == [{"id": "call_0", "name": "get_weather", "arguments": ""}]
    assert read(NAMED, ['{"city": "Pa']) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Pa'}
    ]
    assert read(REQUIRED, ['{"name": "get_wea']) == []
    cut = read(REQUIRED, [TWO[: ARGUMENTS + 3]])
    assert cut == [{"id": "call_0", "name": "get_weather", "arguments": '{"c'}]
    one_and_a_half = read(REQUIRED, [TWO[: TWO.index("get_time") + 22]])
    assert [c["name"] for c in one_and_a_half] == ["get_weather", "get_time"]
    assert one_and_a_half[1]["arguments"] == ""
