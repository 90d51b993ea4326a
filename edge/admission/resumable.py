"""Resumable streams: where any edge finds a request it did not admit, to resume it for its client.

A request sent resumable (a WebSocket ``generate`` or a streamed chat completion with
``"resumable": true``) is not cancelled
when its client goes away: it runs on (bounded by its ``max_tokens`` and deadline) and its client
reconnects, to any edge, with ``resume`` (or ``GET /v1/chat/completions/{id}``; docs/protocol.md, "Resuming a stream"). For that the
admitting edge writes one :class:`ResumableStream` record to the fleet's table (:class:`bus.CompactedTable`,
key ``req:<request id>``) next to the request's publish: who may resume it (the API key's hash)
and where its replies are (:class:`~edge.admission.replay.ReplyOrigin`). The rest (the output) is
read back from the reply topic (:mod:`edge.admission.replay`). Another key's lookup finds nothing,
exactly as an unknown id.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from bus import CompactedTable
from edge.admission.replay import ReplyOrigin

KEY_PREFIX = "req:"


@dataclass(frozen=True, slots=True)
class ResumableStream:
    owner: str  # the SHA-256 hash of the API key that sent the request
    origin: ReplyOrigin
    prompt_tokens: int
    max_tokens: int
    # a resumable chat completion's (edge.openai.resume), so another edge sends the same bytes:
    # its ``created`` time, its sampling seed and the request's JSON body (empty: a WebSocket request)
    created: int = 0
    seed: int | None = None
    body: str = ""


class StreamDirectory:
    """The resumable streams of the fleet, by request id, on a shared table."""

    def __init__(self, table: CompactedTable, lookup_timeout_s: float = 5.0) -> None:
        self.table = table
        self.lookup_timeout_s = lookup_timeout_s

    async def put(self, r: ResumableStream) -> None:
        """Raises :class:`bus.BusError` when the bus does not take it."""
        await self.table.put(KEY_PREFIX + r.origin.request_id, orjson.dumps(r))

    async def get(self, owner: str, request_id: str) -> ResumableStream | None:
        """``request_id``'s record when ``owner`` sent it; ``None`` otherwise (unknown, expired,
        another key's). Raises :class:`bus.BusError` when the table cannot catch up."""
        raw = await self.table.get(KEY_PREFIX + request_id, self.lookup_timeout_s)
        if raw is None:
            return None
        try:
            obj = orjson.loads(raw)
            o = obj["origin"]
            r = ResumableStream(obj["owner"], ReplyOrigin(o["request_id"], o["topic"], int(o["since_ms"])),
                                int(obj["prompt_tokens"]), int(obj["max_tokens"]), int(obj.get("created", 0)),
                                obj.get("seed"), str(obj.get("body", "")))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        return r if r.owner == owner else None
