"""OTLP/HTTP JSON encoding of spans: the body of ``POST <endpoint>/v1/traces``.

The protobuf JSON mapping as OTLP specifies it: ``resourceSpans`` / ``scopeSpans`` / ``spans``,
trace and span ids as lowercase hex (not base64), 64-bit integers (times, ``intValue``) as JSON
strings, enum values as integers. Pure: records in, bytes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from tracing.span import AttrValue, SpanRecord

SCOPE = "lockgate"
STATUS_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR


def _value(v: AttrValue) -> dict[str, Any]:
    if isinstance(v, bool):  # before int: bool is an int
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def _attributes(items: Iterable[tuple[str, AttrValue]]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in items]


def _span(r: SpanRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"traceId": r.trace_id, "spanId": r.span_id, "name": r.name, "kind": int(r.kind),
                           "startTimeUnixNano": str(r.start_ns), "endTimeUnixNano": str(r.end_ns),
                           "attributes": _attributes(r.attributes)}
    if r.parent_id:
        out["parentSpanId"] = r.parent_id
    if r.trace_state:
        out["traceState"] = r.trace_state
    if r.error is not None:
        out["status"] = {"code": STATUS_ERROR, "message": r.error}
    return out


def encode(records: Iterable[SpanRecord], resource: Mapping[str, AttrValue], version: str = "") -> bytes:
    """One ``ExportTraceServiceRequest`` with every record under one resource (``service.name`` and
    the rest of ``resource``) and the ``lockgate`` instrumentation scope."""
    scope: dict[str, Any] = {"name": SCOPE}
    if version:
        scope["version"] = version
    body = {"resourceSpans": [{"resource": {"attributes": _attributes(resource.items())},
                               "scopeSpans": [{"scope": scope, "spans": [_span(r) for r in records]}]}]}
    return orjson.dumps(body)
