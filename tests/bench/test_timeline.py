"""The per-token timeline: `pdserve up --trace-file` writes one trace per request across the
router and both workers (parents linked through gRPC metadata), and `bench.timeline` turns
it into phases and per-token costs."""

from __future__ import annotations

import json

from bench import timeline
from services.launcher import free_port
from services.tracing import read
from tests.support.up import Up


def test_one_request_is_one_trace_across_the_processes(tmp_path):
    trace = tmp_path / "trace.jsonl"
    up = Up("--port", str(free_port()), "--trace-file", str(trace), "--kv-store", "memory://",
            "--dtype", "float32", "--no-colocated")  # fmt: skip
    try:
        url = up.ready().removesuffix("/v1")
        out = tmp_path / "timeline.json"
        argv = ["--trace-file", str(trace), "--base-url", url, "--input-len", "40",
                "--output-len", "8", "--json", str(out)]  # fmt: skip
        assert timeline.main(argv) == 0
    finally:
        up.stop()
    spans = read(str(trace))
    (trace_id,) = {s["trace_id"] for s in spans if s["name"].startswith("POST")}
    mine = {(s["service"], s["name"]): s for s in spans if s["trace_id"] == trace_id}
    assert sorted(mine) == [
        ("pdserve-decode", "Decode"),
        ("pdserve-prefill", "Prefill"),
        ("pdserve-router", "Decode"),
        ("pdserve-router", "POST /v1/completions"),
        ("pdserve-router", "Prefill"),
    ]
    root = mine[("pdserve-router", "POST /v1/completions")]
    for role in ("Prefill", "Decode"):
        call = mine[("pdserve-router", role)]
        assert call["parent_id"] == root["span_id"]
        assert mine[(f"pdserve-{role.lower()}", role)]["parent_id"] == call["span_id"]
    assert root["attributes"]["prompt_tokens"] == 40
    # the first token comes from the prefill worker, the other 7 from 7 decode steps
    decode = mine[("pdserve-decode", "Decode")]
    assert [e["name"] for e in decode["events"]].count("step") == 7
    assert [e["name"] for e in decode["events"]].count("send") == 7
    chunks = [e for e in mine[("pdserve-router", "Decode")]["events"] if e["name"] == "chunk"]
    assert sum(e["tokens"] for e in chunks) == 7
    assert len(mine[("pdserve-prefill", "Prefill")]["events"]) >= 4  # fetched ... stored
    result = json.loads(out.read_text())
    assert result["tokens"]["tokens"] == 7
    assert result["phases"][-1][0] == "first token written (TTFT at the router)"
    assert 0 < result["phases"][-1][1] < result["total_ms"]


def test_waits_for_the_workers_spans_that_land_after_the_routers():
    def span(service: str, name: str, span_id: str, parent_id: str = "") -> dict:
        return {"service": service, "name": name, "span_id": span_id, "parent_id": parent_id}

    router = [
        span("pdserve-router", "POST /v1/completions", "r"),
        span("pdserve-router", "Prefill", "rp", "r"),
        span("pdserve-router", "Decode", "rd", "r"),
    ]
    prefill = span("pdserve-prefill", "Prefill", "p", "rp")
    decode = span("pdserve-decode", "Decode", "d", "rd")
    assert not timeline.complete([*router[1:], prefill, decode])  # no root yet
    assert not timeline.complete([*router, prefill])  # the decode worker's still to come
    assert timeline.complete([*router, prefill, decode])
