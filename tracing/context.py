"""W3C Trace Context (``traceparent``): the ids a span is known by across processes.

Sans-I/O and dependency-free: the edge writes the header on the request record it publishes, the
worker reads it back from the record's headers (both buses carry record headers unchanged), so
neither needs to know the other's tracer. Format (version 00)::

    traceparent: 00-<trace-id: 32 hex>-<parent-id: 16 hex>-<flags: 2 hex>

A header that does not parse is ignored (the receiver starts a new trace), as the spec asks: a
malformed or foreign header must never fail the request that carries it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

HEADER = "traceparent"
_HEX = frozenset("0123456789abcdef")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()


@dataclass(frozen=True, slots=True)
class SpanContext:
    """A span's identity as another process sees it: lowercase hex ids and the sampled flag."""

    trace_id: str
    span_id: str
    sampled: bool = True

    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def _hex(s: str, n: int) -> bool:
    return len(s) == n and _HEX.issuperset(s)


def parse_traceparent(value: str | bytes | None) -> SpanContext | None:
    """The context in a ``traceparent`` value, or None when it is absent or malformed (all-zero
    ids, uppercase hex, version ``ff``, a version-00 header with extra fields)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    parts = value.strip().split("-")
    if len(parts) < 4:
        return None
    version, trace_id, span_id, flags = parts[:4]
    if not _hex(version, 2) or version == "ff" or (version == "00" and len(parts) != 4):
        return None
    if not _hex(trace_id, 32) or trace_id == _ZERO_TRACE or not _hex(span_id, 16) or span_id == _ZERO_SPAN:
        return None
    if not _hex(flags, 2):
        return None
    return SpanContext(trace_id, span_id, bool(int(flags, 16) & 1))


def from_headers(headers: Iterable[tuple[str, bytes]]) -> SpanContext | None:
    """The context of a bus record's ``traceparent`` header (the first one), or None."""
    for key, value in headers:
        if key == HEADER:
            return parse_traceparent(value)
    return None


def to_headers(ctx: SpanContext) -> tuple[tuple[str, bytes]]:
    """The record headers that carry ``ctx`` (what :func:`from_headers` reads back)."""
    return ((HEADER, ctx.traceparent().encode("ascii")),)
