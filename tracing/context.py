"""W3C Trace Context (``traceparent``): the ids a span is known by across processes.

Sans-I/O and dependency-free: the edge writes the header on the request record it publishes, the
worker reads it back from the record's headers (both buses carry record headers unchanged), so
neither needs to know the other's tracer. Format (version 00)::

    traceparent: 00-<trace-id: 32 hex>-<parent-id: 16 hex>-<flags: 2 hex>
    tracestate:  <vendor key>=<opaque value>,...      (optional, carried unchanged)

``tracestate`` belongs to the vendors upstream of lockgate: it is kept only beside a valid
``traceparent``, passed on as received (after a syntax check: at most 32 members and 512
characters) on the bus record and on every exported span (``traceState``), never edited.

A header that does not parse is ignored (the receiver starts a new trace), as the spec asks: a
malformed or foreign header must never fail the request that carries it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

HEADER = "traceparent"
STATE_HEADER = "tracestate"
MAX_STATE_MEMBERS = 32  # W3C Trace Context: a tracestate list holds at most 32 members
MAX_STATE_CHARS = 512  # the length the spec lets a platform truncate to
# W3C Trace Context's list-member grammar: a key (simple, or multi-tenant ``tenant@system``) and a
# value of printable ASCII without ``,`` and ``=``, not ending in a space
_STATE_KEY = re.compile(r"[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}")
_STATE_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
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
    trace_state: str = ""  # the upstream vendors' tracestate, as received ("" when none)

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


def parse_tracestate(value: str | bytes | None) -> str:
    """``value`` of a ``tracestate`` header, normalised (members trimmed, empty ones dropped), or ""
    when absent or malformed (a member outside the spec's ``key=value`` grammar: an uppercase or
    over-long key, ``=`` in a value, non-printable or non-ASCII text; more
    than :data:`MAX_STATE_MEMBERS` members, longer than :data:`MAX_STATE_CHARS`): the spec asks to
    drop a tracestate that does not parse rather than pass part of it on."""
    if not value:
        return ""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return ""
    members = [m.strip() for m in value.split(",") if m.strip()]
    if len(members) > MAX_STATE_MEMBERS:
        return ""
    for m in members:
        key, eq, val = m.partition("=")
        if not eq or not _STATE_KEY.fullmatch(key) or not _STATE_VALUE.fullmatch(val):
            return ""
    out = ",".join(members)
    return out if len(out) <= MAX_STATE_CHARS else ""


def parse_headers(traceparent: str | bytes | None, tracestate: str | bytes | None = None) -> SpanContext | None:
    """The context of a ``traceparent`` / ``tracestate`` pair (HTTP or record headers), or None
    when ``traceparent`` is absent or malformed (a lone ``tracestate`` is dropped)."""
    ctx = parse_traceparent(traceparent)
    if ctx is None:
        return None
    state = parse_tracestate(tracestate)
    return SpanContext(ctx.trace_id, ctx.span_id, ctx.sampled, state) if state else ctx


def from_headers(headers: Iterable[tuple[str, bytes]]) -> SpanContext | None:
    """The context of a bus record's ``traceparent`` (and ``tracestate``) headers (the first of
    each), or None."""
    parent: bytes | None = None
    state: bytes | None = None
    for key, value in headers:
        if key == HEADER and parent is None:
            parent = value
        elif key == STATE_HEADER and state is None:
            state = value
    return parse_headers(parent, state)


def to_headers(ctx: SpanContext) -> tuple[tuple[str, bytes], ...]:
    """The record headers that carry ``ctx`` (what :func:`from_headers` reads back)."""
    out: tuple[tuple[str, bytes], ...] = ((HEADER, ctx.traceparent().encode("ascii")),)
    if ctx.trace_state:
        out += ((STATE_HEADER, ctx.trace_state.encode("ascii")),)
    return out
