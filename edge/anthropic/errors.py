"""Anthropic's error shape and statuses, and its SSE framing (pure: the sink and the routes share
them; the sink cannot reach admission).

Errors are ``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's status
for each type; the edge's one vocabulary (:class:`bus.ErrorCode`) is mapped here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from bus import ErrorCode

API = "anthropic"  # the metrics' api label

# edge error code -> (HTTP status, Anthropic error type), as Anthropic documents its errors
HTTP_ERRORS: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    "model_not_found": (404, "not_found_error"),
    "not_found": (404, "not_found_error"),
    "request_too_large": (413, "request_too_large"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.INTERNAL: (500, "api_error"),
    ErrorCode.EXPIRED: (504, "timeout_error"),
    ErrorCode.OVERLOADED: (529, "overloaded_error"),
}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A refused or failed request's answer: status, Anthropic's error body, ``Retry-After`` seconds."""

    status: int
    body: dict[str, Any]
    retry_after: float | None = None


def error_reply(code: str, message: str, retry_after: float | None = None) -> ErrorReply:
    """The one mapping of an edge error code (a refusal's, or a failed stream's) to Anthropic's;
    codes forwarded from a worker that have no mapping are 500 ``api_error`` naming the code."""
    status, kind = HTTP_ERRORS.get(code, (500, "api_error"))
    if code not in HTTP_ERRORS:
        message = f"{code}: {message}"
    return ErrorReply(status, {"type": "error", "error": {"type": kind, "message": message}}, retry_after)


def event(kind: str, obj: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic frames it: a named event whose data carries the same ``type``."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"
