"""Per-request log context: the request id (and W3C trace id, where a tracer set one) that the
code handling a request is working for, read by the JSON log formatter (``--log-format json``).

Context variables, not globals: asyncio copies the context into each task, so a value bound while
one request is handled never shows on another task's lines. Plain strings only; ``bus`` imports
nothing of ours and nothing of OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("lockgate_request_id", default=None)
TRACE_ID: ContextVar[str | None] = ContextVar("lockgate_trace_id", default=None)


@contextmanager
def bound(request_id: str | None, trace_id: str | None = None) -> Iterator[None]:
    """Log lines emitted inside the block carry ``request_id`` (and ``trace_id``); the values the
    context had before come back on exit, also when the block raises."""
    rid = REQUEST_ID.set(request_id)
    tid = TRACE_ID.set(trace_id) if trace_id is not None else None
    try:
        yield
    finally:
        if tid is not None:
            TRACE_ID.reset(tid)
        REQUEST_ID.reset(rid)
