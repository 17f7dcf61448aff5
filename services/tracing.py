"""Where a request's time goes: spans across the router and the workers, written out only when
asked (the router keeps its own in memory for its console: router/console/recent.py).

The `trace_file` setting (`--trace-file PATH`, `PDSERVE_TRACE_FILE`; `pdserve up` passes it
to every service) turns tracing on: each process appends its finished spans to PATH, one
OpenTelemetry OTLP/JSON `ExportTraceServiceRequest` per line (what the OpenTelemetry
Collector's `otlpjsonfile` receiver reads, so the spans can go on to Jaeger or Tempo). The
trace context travels as W3C `traceparent`: from the client's HTTP header when it sends one
(else a new trace per request), to the workers in gRPC metadata. `python -m bench.timeline`
sends one request and prints its spans as a timeline.

Spans carry events for what happens many times (each engine step that computed a token for
the request, each chunk sent): a per-token timeline without a span per token. With tracing
off every call here is a no-op on a shared `NO_SPAN`.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

RECEIVED = "pdserve.received_ns"  # ASGI scope key: when the router read the request line
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
SERVER, CLIENT, INTERNAL = 2, 3, 1  # OTLP span kinds


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    exporter: Sink | None
    start_ns: int = field(default_factory=time.time_ns)
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)

    @property
    def recording(self) -> bool:
        return self.exporter is not None

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"

    def child(self, name: str, kind: int = INTERNAL, **attributes: Any) -> Span:
        if self.exporter is None:
            return self
        return Span(
            name, self.trace_id, new_id(8), self.span_id, kind, self.exporter, attributes=attributes
        )

    def event(self, name: str, at_ns: int | None = None, **attributes: Any) -> None:
        if self.exporter is not None:
            self.events.append((at_ns or time.time_ns(), name, attributes))

    def set(self, **attributes: Any) -> None:
        if self.exporter is not None:
            self.attributes.update(attributes)

    def end(self, at_ns: int | None = None) -> None:
        if self.exporter is not None:
            self.exporter.export(self, at_ns or time.time_ns())
            self.exporter = None  # ended once


NO_SPAN = Span("", "0" * 32, "0" * 16, "", INTERNAL, None)


class Sink(Protocol):
    """Where finished spans go: a file (Exporter), or a process's own use of them."""

    def export(self, span: Span, end_ns: int) -> None: ...


class Tee:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def export(self, span: Span, end_ns: int) -> None:
        for sink in self.sinks:
            sink.export(span, end_ns)


class Exporter:
    """Appends finished spans to a file as OTLP/JSON lines; one process, many threads."""

    def __init__(self, path: str, service: str) -> None:
        self.service = service
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (lives with the process)
        self._lock = threading.Lock()

    def export(self, span: Span, end_ns: int) -> None:
        line = json.dumps(otlp(span, end_ns, self.service), separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")


class Tracer:
    """Starts spans for one service: recorded to `path` and given to `sink` (the router's
    console keeps its last requests' spans), or no-ops when there are neither."""

    def __init__(self, service: str, path: str | None, sink: Sink | None = None) -> None:
        sinks = ([Exporter(path, service)] if path else []) + ([sink] if sink else [])
        self.exporter: Sink | None = None
        if sinks:
            self.exporter = sinks[0] if len(sinks) == 1 else Tee(sinks)

    @property
    def enabled(self) -> bool:
        return self.exporter is not None

    def start(self, name: str, traceparent: str | None, kind: int = SERVER, **attrs: Any) -> Span:
        """A span continuing the caller's trace (a `traceparent` value), or a new trace."""
        if self.exporter is None:
            return NO_SPAN
        match = TRACEPARENT.fullmatch(traceparent or "")
        trace_id, parent = (match.group(1), match.group(2)) if match else (new_id(16), "")
        return Span(name, trace_id, new_id(8), parent, kind, self.exporter, attributes=attrs)


def from_metadata(metadata: Any) -> str | None:
    """The traceparent in a gRPC call's invocation metadata, if any."""
    for key, value in metadata or ():
        if key == "traceparent":
            return str(value)
    return None


def new_id(nbytes: int) -> str:
    return secrets.token_hex(nbytes)


def otlp(span: Span, end_ns: int, service: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "traceId": span.trace_id,
        "spanId": span.span_id,
        "name": span.name,
        "kind": span.kind,
        "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(end_ns),
        "attributes": attributes(span.attributes),
        "events": [
            {"timeUnixNano": str(t), "name": name, "attributes": attributes(attrs)}
            for t, name, attrs in span.events
        ],
    }
    if span.parent_id:
        body["parentSpanId"] = span.parent_id
    resource = {"attributes": attributes({"service.name": service})}
    scope = {"scope": {"name": "pdserve"}, "spans": [body]}
    return {"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}


def attributes(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(v)} for k, v in values.items()]


def any_value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}  # OTLP/JSON writes 64-bit integers as strings
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def read(path: str) -> list[dict[str, Any]]:
    """The spans in an OTLP/JSON lines file, flattened: name, service, ids, times (ns),
    attributes and events as plain dicts."""
    spans = []
    with open(path) as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                service = plain(rs["resource"]["attributes"]).get("service.name", "")
                for ss in rs["scopeSpans"]:
                    spans += [flat(s, service) for s in ss["spans"]]
    return spans


def flat(span: dict[str, Any], service: str) -> dict[str, Any]:
    return {
        "name": span["name"],
        "service": service,
        "trace_id": span["traceId"],
        "span_id": span["spanId"],
        "parent_id": span.get("parentSpanId", ""),
        "start": int(span["startTimeUnixNano"]),
        "end": int(span["endTimeUnixNano"]),
        "attributes": plain(span["attributes"]),
        "events": [
            {"time": int(e["timeUnixNano"]), "name": e["name"], **plain(e["attributes"])}
            for e in span["events"]
        ],
    }


def plain(attrs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for a in attrs:
        ((kind, value),) = a["value"].items()
        out[a["key"]] = int(value) if kind == "intValue" else value
    return out
