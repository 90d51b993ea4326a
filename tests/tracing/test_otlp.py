"""The OTLP/HTTP JSON body, checked against the official protobuf definitions (strict parse)."""

from __future__ import annotations

import orjson

from tests.tracing.receiver import flatten, parse_otlp_json
from tracing import SpanKind, SpanRecord, encode

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_the_body_is_an_export_trace_service_request() -> None:
    big = (1 << 63) - 1
    records = [
        SpanRecord(TRACE, "00f067aa0ba902b7", "", "root", SpanKind.SERVER, 1_700_000_000_000_000_000,
                   1_700_000_000_500_000_000, (("s", "text"), ("i", big), ("b", True), ("f", 0.25), ("neg", -3))),
        SpanRecord(TRACE, "1111111111111111", "00f067aa0ba902b7", "child", SpanKind.CONSUMER, 1, 2, (), "boom",
                   "congo=t61rcWkgMzE"),
    ]
    body = encode(records, {"service.name": "lockgate-edge", "service.instance.id": "h-1"}, "0.1")
    msg = parse_otlp_json(body)
    (rs,) = msg.resource_spans
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("lockgate", "0.1")
    root, child = flatten(msg)
    assert root.resource == {"service.name": "lockgate-edge", "service.instance.id": "h-1"}
    assert (root.trace_id, root.span_id, root.parent_id, root.name, root.kind) == (TRACE, "00f067aa0ba902b7", "", "root", 2)
    assert (root.start_ns, root.end_ns) == (1_700_000_000_000_000_000, 1_700_000_000_500_000_000)
    # bool stays bool (not an int), 64-bit ints survive (carried as JSON strings), doubles as doubles
    assert root.attributes == {"s": "text", "i": big, "b": True, "f": 0.25, "neg": -3}
    assert root.status_code == 0  # unset
    assert (child.parent_id, child.kind, child.status_code, child.status_message) == ("00f067aa0ba902b7", 5, 2, "boom")
    assert (root.trace_state, child.trace_state) == ("", "congo=t61rcWkgMzE")  # Span.trace_state


def test_json_shape_follows_the_otlp_mapping() -> None:
    """What a strict parser would not catch: ids as hex (not base64), 64-bit ints as strings,
    enums as integers, no parentSpanId on a root."""
    r = SpanRecord(TRACE, "00f067aa0ba902b7", "", "root", SpanKind.PRODUCER, 5, 6, (("n", 1),))
    doc = orjson.loads(encode([r], {"service.name": "x"}))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == TRACE and span["spanId"] == "00f067aa0ba902b7" and "parentSpanId" not in span
    assert span["startTimeUnixNano"] == "5" and span["endTimeUnixNano"] == "6" and span["kind"] == 4
    assert span["attributes"] == [{"key": "n", "value": {"intValue": "1"}}]
    assert "version" not in doc["resourceSpans"][0]["scopeSpans"][0]["scope"]


def test_an_empty_batch_is_still_valid() -> None:
    msg = parse_otlp_json(encode([], {"service.name": "x"}))
    assert flatten(msg) == []
