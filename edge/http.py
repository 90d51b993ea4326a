"""HTTP pieces both public APIs (OpenAI's and Anthropic's) answer with, whatever their error shapes:
a JSON reply with an optional ``Retry-After``, and the headers of a server-sent-events stream."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

# text/event-stream, never cached, and not buffered by a proxy in front (nginx reads X-Accel-Buffering)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(status: int, body: Any, retry_after: float | None = None) -> web.Response:
    """``body`` as JSON; ``retry_after`` seconds, rounded up to a whole second (at least 1), as the
    ``Retry-After`` header of a 429 / 503."""
    headers = {"Retry-After": str(max(1, int(-(-retry_after // 1))))} if retry_after is not None else None
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)
