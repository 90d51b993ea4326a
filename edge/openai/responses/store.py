"""Stored responses for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

In the edge's memory, per tenant (a tenant never reads another's response), bounded twice: at most
``max_items`` responses (the oldest evicted first) and each for ``ttl_s`` seconds after it was
stored. A response made with ``store: false`` is never put here. An edge restart, or a follow-up
turn that reaches another edge replica, finds nothing: the client gets a 404 naming
``previous_response_id`` and can send the whole conversation as ``input`` instead (see
docs/protocol.md, "Responses API"). The clock is injected (tests, and no wall-clock jumps).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ITEMS = 4096
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The response object as it was answered, and the conversation (chat messages, without the
    instructions) that a follow-up turn continues."""

    response: dict[str, Any]
    history: tuple[dict[str, Any], ...]
    stored_at: float
    input_items: tuple[dict[str, Any], ...] = ()  # the request's own input (edge.openai.responses.items)


class ResponseStore:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or not ttl_s > 0:
            raise ValueError(f"max_items must be >= 1 and ttl_s > 0, got {max_items}, {ttl_s}")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self, now: float) -> None:
        while self._items:
            key, first = next(iter(self._items.items()))
            if now - first.stored_at < self.ttl_s:
                break
            del self._items[key]

    def put(self, tenant: str, response: dict[str, Any], history: tuple[dict[str, Any], ...],
            input_items: tuple[dict[str, Any], ...] = ()) -> None:
        now = self.clock()
        self._expire(now)
        self._items[(tenant, response["id"])] = StoredResponse(response, history, now, input_items)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._expire(self.clock())
        return self._items.get((tenant, response_id))

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._items.pop((tenant, response_id), None) is not None
