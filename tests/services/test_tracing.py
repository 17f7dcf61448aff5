"""Spans as OpenTelemetry's OTLP/JSON: the caller's W3C trace context continued, children in
the same trace, events and attributes written and read back exactly; no-ops when off."""

from __future__ import annotations

import json

from services.tracing import CLIENT, NO_SPAN, SERVER, Tracer, from_metadata, read

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_spans_continue_the_callers_trace_and_read_back_exactly(tmp_path):
    path = tmp_path / "trace.jsonl"
    tracer = Tracer("pdserve-router", str(path))
    root = tracer.start("POST /v1/completions", f"00-{TRACE}-{PARENT}-01", prompt_tokens=12)
    root.start_ns = 1_000
    call = root.child("Decode", CLIENT, worker="127.0.0.1:5")
    call.start_ns = 2_000
    call.event("chunk", 2_500, tokens=3)
    call.end(3_000)
    root.event("written", 3_100, tokens=3)
    root.set(stream=True, share=0.5)
    root.end(4_000)
    root.end(5_000)  # a span ends once

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    otlp = json.loads(lines[1])["resourceSpans"][0]
    assert otlp["resource"]["attributes"] == [
        {"key": "service.name", "value": {"stringValue": "pdserve-router"}}
    ]
    assert otlp["scopeSpans"][0]["spans"][0]["kind"] == SERVER
    decode, post = read(str(path))
    assert post == {
        "name": "POST /v1/completions",
        "service": "pdserve-router",
        "trace_id": TRACE,
        "span_id": root.span_id,
        "parent_id": PARENT,
        "start": 1_000,
        "end": 4_000,
        "attributes": {"prompt_tokens": 12, "stream": True, "share": 0.5},
        "events": [{"time": 3_100, "name": "written", "tokens": 3}],
    }
    assert decode["trace_id"] == TRACE and decode["parent_id"] == root.span_id
    assert decode["events"] == [{"time": 2_500, "name": "chunk", "tokens": 3}]
    assert decode["attributes"] == {"worker": "127.0.0.1:5"}
    assert call.traceparent == f"00-{TRACE}-{call.span_id}-01"
    assert from_metadata((("x", "1"), ("traceparent", call.traceparent))) == call.traceparent


def test_a_request_without_a_valid_traceparent_starts_a_new_trace(tmp_path):
    tracer = Tracer("pdserve-decode", str(tmp_path / "t.jsonl"))
    for header in (None, "garbage", f"00-{TRACE.upper()}-{PARENT}-01"):
        span = tracer.start("Decode", header)
        assert span.recording and span.parent_id == "" and span.trace_id != TRACE
        assert len(span.trace_id) == 32 and len(span.span_id) == 16


def test_tracing_is_off_without_a_file(tmp_path):
    tracer = Tracer("pdserve-router", None)
    span = tracer.start("POST /v1/completions", f"00-{TRACE}-{PARENT}-01")
    assert span is NO_SPAN and not tracer.enabled
    assert span.child("Decode") is NO_SPAN
    span.event("written", tokens=1)
    span.end()
    assert NO_SPAN.events == [] and list(tmp_path.iterdir()) == []


def test_a_trace_file_that_cannot_be_written_is_refused_at_start(tmp_path):
    import subprocess

    from services.launcher import PDSERVE

    path = tmp_path / "missing" / "trace.jsonl"
    run = subprocess.run(
        [PDSERVE, "router", "--trace-file", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"pdserve: error: trace_file: cannot append to {path}:")
