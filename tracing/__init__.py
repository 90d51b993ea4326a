"""Distributed tracing for lockgate: W3C ``traceparent`` / ``tracestate`` propagation, a sans-I/O span recorder and a
bounded OTLP/HTTP (JSON) exporter. Imports nothing of ours (an import-linter contract); the edge
and the worker both use it, the bus only carries its header as bytes.

Off by default: with no OTLP endpoint configured nothing here is constructed and callers hold
``tracer = None`` (docs/observability.md, "Tracing").
"""

from tracing.context import (
    HEADER,
    STATE_HEADER,
    SpanContext,
    from_headers,
    parse_headers,
    parse_traceparent,
    parse_tracestate,
    to_headers,
)
from tracing.exporter import OtlpExporter, traces_url
from tracing.otlp import encode
from tracing.span import AttrValue, Span, SpanKind, SpanRecord, Tracer, ratio_sampled

__all__ = [
    "HEADER",
    "STATE_HEADER",
    "AttrValue",
    "OtlpExporter",
    "Span",
    "SpanContext",
    "SpanKind",
    "SpanRecord",
    "Tracer",
    "encode",
    "from_headers",
    "parse_headers",
    "parse_traceparent",
    "parse_tracestate",
    "ratio_sampled",
    "to_headers",
    "traces_url",
]
