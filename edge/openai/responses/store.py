"""Stored responses, shared by every edge of the fleet: ``previous_response_id``, ``GET``, ``DELETE``,
``cancel`` and resuming a stream, on whichever edge the call lands.

A response lives in the bus table ``<ns>.table.responses`` (:class:`bus.CompactedTable`, keyed by
response id), not in one edge's memory. Its record is written twice:

1. when the request is admitted (``status: in_progress``): who made it (the API key's hash: only
   that key may read, resume, cancel or delete it; any other key gets the 404 of an unknown id),
   the request body (a replay re-parses it to rebuild the same sink), and where its replies are
   (:class:`~edge.admission.replay.ReplyOrigin`): enough for any edge, one started cold included,
   to rebuild its output from the reply topic;
2. when it ends, by the edge that saw the end (the admitting edge, or any edge that replayed it to
   its end after the first died): the final response object and the conversation a follow-up turn
   continues.

A response made with ``store: false`` is never written. Bounds (flags, docs/protocol.md): the
table's retention (``--responses-retention``: a record older than it is gone on every edge), each
edge's view size (``--responses-max-stored``: the oldest are evicted first) and the record size
(``--responses-max-bytes``: a larger request is not stored; a background one is refused). A
``DELETE`` writes a tombstone: gone on every edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from bus import CompactedTable
from edge.admission.replay import ReplyOrigin

FINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as the fleet knows it. ``response`` is the final object (``None`` while it
    runs); ``history``: the chat turns a follow-up continues (final only); ``previous``: the
    stored history its own request continued (a replay re-parses ``body`` with it)."""

    id: str
    owner: str  # the SHA-256 hash of the API key that made it
    status: str
    created_at: int
    background: bool
    origin: ReplyOrigin
    prompt_tokens: int
    body: dict[str, Any]
    previous: tuple[dict[str, Any], ...] = ()
    response: dict[str, Any] | None = None
    history: tuple[dict[str, Any], ...] = ()
    input_items: tuple[dict[str, Any], ...] = field(default=())

    @property
    def final(self) -> bool:
        return self.response is not None

    def ended(self, response: dict[str, Any], history: tuple[dict[str, Any], ...],
              input_items: tuple[dict[str, Any], ...]) -> StoredResponse:
        return replace(self, status=response["status"], response=response, history=history, input_items=input_items)


def encode_stored(r: StoredResponse) -> bytes:
    return orjson.dumps(r)


def decode_stored(data: bytes) -> StoredResponse:
    """Raises ``ValueError`` naming what is wrong with a record (it is then treated as absent)."""
    try:
        obj = orjson.loads(data)
        o = obj["origin"]
        return StoredResponse(
            id=obj["id"], owner=obj["owner"], status=obj["status"], created_at=int(obj["created_at"]),
            background=bool(obj["background"]), origin=ReplyOrigin(o["request_id"], o["topic"], int(o["since_ms"])),
            prompt_tokens=int(obj["prompt_tokens"]), body=obj["body"], previous=tuple(obj.get("previous") or ()),
            response=obj.get("response"), history=tuple(obj.get("history") or ()),
            input_items=tuple(obj.get("input_items") or ()))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a stored response: {exc!r}") from None


class ResponseStore:
    """The responses table as typed records. ``owner`` is always checked: another key's response
    reads as absent."""

    def __init__(self, table: CompactedTable, lookup_timeout_s: float = 5.0) -> None:
        self.table = table
        self.lookup_timeout_s = lookup_timeout_s

    def fits(self, r: StoredResponse) -> bool:
        return len(encode_stored(r)) <= self.table.max_value_bytes

    async def put(self, r: StoredResponse) -> None:
        """Raises ``ValueError`` (too large) or :class:`bus.BusError`."""
        await self.table.put(r.id, encode_stored(r))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        raw = await self.table.get(response_id, self.lookup_timeout_s)
        if raw is None:
            return None
        try:
            r = decode_stored(raw)
        except ValueError:
            return None
        return r if r.owner == owner else None

    async def delete(self, owner: str, response_id: str) -> bool:
        if await self.get(owner, response_id) is None:
            return False
        await self.table.delete(response_id)
        return True
