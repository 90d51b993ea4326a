"""Spans: a small sans-I/O recorder. A :class:`Tracer` hands every ended span, as a frozen
:class:`SpanRecord`, to its sink (the OTLP exporter's bounded queue, or a list in tests).

Why not the OpenTelemetry SDK: lockgate needs spans, a parent chain and OTLP/HTTP export, nothing
more; the SDK would be a dependency of every process for that. Zero cost when tracing is off: the
code holds ``tracer: Tracer | None`` and builds no span at all when it is None.

Times are UNIX nanoseconds (``time.time_ns()``), as OTLP wants them. Not thread-safe: a span is
started and ended on one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from tracing.context import SpanContext, new_span_id, new_trace_id

AttrValue = str | bool | int | float


class SpanKind(IntEnum):
    """OTLP's ``Span.SpanKind`` values."""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3
    PRODUCER = 4
    CONSUMER = 5


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """An ended span, as exported. ``parent_id`` is "" for a trace's root span."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: SpanKind
    start_ns: int
    end_ns: int
    attributes: tuple[tuple[str, AttrValue], ...] = ()
    error: str | None = None  # the status message of a span that failed; None: unset (ok)
    trace_state: str = ""  # the trace's upstream tracestate, carried unchanged (tracing.context)


class Span:
    """An open span. :meth:`end` records it once (only when its context is sampled: the flag comes
    from the parent, so the whole trace is kept or none of it); later calls are ignored."""

    __slots__ = ("_tracer", "name", "context", "parent_id", "kind", "start_ns", "attributes", "error", "ended")

    def __init__(self, tracer: Tracer, name: str, context: SpanContext, parent_id: str, kind: SpanKind,
                 start_ns: int, attributes: dict[str, AttrValue]) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent_id = parent_id
        self.kind = kind
        self.start_ns = start_ns
        self.attributes = attributes
        self.error: str | None = None
        self.ended = False

    def set(self, key: str, value: AttrValue | None) -> None:
        if value is not None:
            self.attributes[key] = value

    def fail(self, message: str) -> None:
        self.error = message[:300]

    def end(self, end_ns: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        end = time.time_ns() if end_ns is None else max(end_ns, self.start_ns)
        c = self.context
        if not c.sampled:  # parent-based sampling: a client that did not sample its trace gets none of ours
            return
        self._tracer.sink(SpanRecord(c.trace_id, c.span_id, self.parent_id, self.name, self.kind, self.start_ns, end,
                                     tuple(self.attributes.items()), self.error, c.trace_state))


def ratio_sampled(trace_id: str, ratio: float) -> bool:
    """OpenTelemetry's ``TraceIdRatioBased`` decision: keep a trace whose id's low 64 bits, read as
    an unsigned integer, fall below ``ratio`` x 2^64. A pure function of the id, so every process
    that starts a root for that id decides alike, and ratios nest (a trace kept at 0.1 is kept at 0.5)."""
    if ratio >= 1.0:
        return True
    return int(trace_id[-16:], 16) < int(ratio * (1 << 64))


class Tracer:
    """Starts spans and sends the ended ones to ``sink`` (called synchronously, must not block).

    Sampling is parent-based: a span with a parent follows the parent's sampled flag; a new root is
    kept for ``sample_ratio`` of trace ids (:func:`ratio_sampled`; 1.0: every one). An unsampled
    root still propagates (flag ``00``), so the worker's spans of it are dropped too."""

    def __init__(self, sink: Callable[[SpanRecord], None], sample_ratio: float = 1.0) -> None:
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be within [0, 1], got {sample_ratio!r}")
        self.sink = sink
        self.sample_ratio = sample_ratio

    def start(self, name: str, parent: SpanContext | Span | None = None, kind: SpanKind = SpanKind.INTERNAL,
              start_ns: int | None = None, attributes: Mapping[str, AttrValue | None] | None = None) -> Span:
        """A span child of ``parent`` (a new trace's root when None), started at ``start_ns`` (now)."""
        pctx = parent.context if isinstance(parent, Span) else parent
        if pctx is not None:
            ctx = SpanContext(pctx.trace_id, new_span_id(), pctx.sampled, pctx.trace_state)
        else:
            trace_id = new_trace_id()
            ctx = SpanContext(trace_id, new_span_id(), ratio_sampled(trace_id, self.sample_ratio))
        attrs = {k: v for k, v in attributes.items() if v is not None} if attributes else {}
        return Span(self, name, ctx, pctx.span_id if pctx else "", kind,
                    time.time_ns() if start_ns is None else start_ns, attrs)

    def record(self, name: str, parent: SpanContext | Span, start_ns: int, end_ns: int,
               kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, AttrValue | None] | None = None) -> None:
        """A span whose times are known already (a phase measured elsewhere, e.g. by the engine)."""
        self.start(name, parent, kind, start_ns, attributes).end(end_ns)
