"""Prefix-affine partitioning: which partition of its tier's topic a request goes to.

A request's *prefix* is its tenant plus the part of its prompt that other requests of the tenant
share: the chat's system message when it has one, else its first ``prefix_tokens`` token ids
(``EdgeConfig.affinity_tokens``, default 64 = 4 KV blocks of 16). Requests with the same prefix go
to the same partition, so to the worker that holds it and whose prefix cache has that prefix's KV
(the cache is salted per tenant anyway: two tenants never share a cached block, so the tenant is in
the key and two tenants' equal prompts are placed independently). A prompt no longer than
``prefix_tokens`` without a system message has nothing worth a cache block in common: it is
spread by its request id, as before.

**Hot prefixes spill.** One prefix must not load one partition (one worker) beyond a partition's
share of the topic. The edge counts each prefix over its last ``window`` requests to the topic; a
prefix with share ``s`` of them is spread over ``fan = min(N, ceil(s · N / spill_share))``
consecutive partitions ``(home + j) mod N``, each request to the one of them holding the fewest of
the prefix's requests in the window, with ``N`` the topic's partitions and ``home`` = murmur2(key)
mod N. So a single prefix puts at most
``spill_share · window / N + 1`` of the last ``window`` requests on any one partition (1/N of the
topic's traffic at the default 1.0: one partition's fair share), and uses as few partitions (prefix
caches) as that allows. Shares count against a full window, so at start-up nothing spills. The reply keying (by request id) and crash recovery (``worker.resume``) do not depend on
the request topic's key.

:func:`prefix_key` and :class:`PrefixAffinity` are pure; :class:`Placement` adds the topic's partition
count from the bus. Not thread-safe: one owner (the edge's event loop). Memory: ``window`` keys per topic.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bus import ChatMessage, InferenceRequest, partition_for_key

log = logging.getLogger(__name__)

DEFAULT_PREFIX_TOKENS = 64
DEFAULT_WINDOW = 512


def prefix_key(tenant: str, prompt_token_ids: Sequence[int], messages: Sequence[ChatMessage] | None,
               prefix_tokens: int = DEFAULT_PREFIX_TOKENS, lora: str | None = None) -> bytes | None:
    """The affinity key of a request (a hex digest), or None when it has no shareable prefix.
    A LoRA adapter is part of it: no KV is shared across adapters (docs/lora.md), so requests
    for different adapters gain nothing from meeting on one worker."""
    h = hashlib.blake2b(digest_size=12)
    h.update(tenant.encode("utf-8", "surrogatepass") + b"\x00")
    if lora is not None:
        h.update(b"l\x00" + lora.encode("utf-8", "surrogatepass") + b"\x00")
    if messages and messages[0].role == "system":
        h.update(b"s\x00" + messages[0].content.encode("utf-8", "surrogatepass"))
    elif len(prompt_token_ids) > prefix_tokens:
        h.update(b"t\x00" + b",".join(str(t).encode() for t in prompt_token_ids[:prefix_tokens]))
    else:
        return None
    return h.hexdigest().encode()


class PartitionSource(Protocol):
    async def partitions_for(self, topic: str) -> list[int]: ...


@dataclass(slots=True)
class _TopicWindow:
    recent: deque[tuple[bytes, int]] = field(default_factory=deque)  # (prefix, partition) of the last requests
    counts: Counter[bytes] = field(default_factory=Counter)  # per prefix, in the window
    spread: dict[bytes, Counter[int]] = field(default_factory=dict)  # per prefix: partition -> requests


class PrefixAffinity:
    def __init__(self, prefix_tokens: int = DEFAULT_PREFIX_TOKENS, window: int = DEFAULT_WINDOW,
                 spill_share: float = 1.0) -> None:
        if prefix_tokens < 1 or window < 1 or not spill_share > 0:
            raise ValueError("prefix_tokens and window must be >= 1 and spill_share > 0")
        self.prefix_tokens, self.window, self.spill_share = prefix_tokens, window, spill_share
        self._topics: dict[str, _TopicWindow] = {}

    def place(self, topic: str, key: bytes, partitions: int) -> int:
        """The partition for the next request of prefix ``key`` on ``topic`` (``partitions`` of them):
        of the prefix's ``fan`` partitions, the one holding the fewest of its requests in the window
        (the home partition on ties), so no partition takes more than ``spill_share · window / N + 1``."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        w = self._topics.get(topic)
        if w is None:
            w = self._topics[topic] = _TopicWindow()
        if len(w.recent) >= self.window:
            old, old_part = w.recent.popleft()
            w.counts[old] -= 1
            w.spread[old][old_part] -= 1
            if not w.counts[old]:
                del w.counts[old], w.spread[old]
        w.counts[key] += 1
        spread = w.spread.setdefault(key, Counter())
        home, fan = partition_for_key(key, partitions), self.fan_out(topic, key, partitions)
        part = min(((home + j) % partitions for j in range(fan)), key=lambda p: (spread[p], (p - home) % partitions))
        spread[part] += 1
        w.recent.append((key, part))
        return part

    def fan_out(self, topic: str, key: bytes, partitions: int) -> int:
        """How many partitions ``key`` is spread over now (for tests and metrics)."""
        w = self._topics.get(topic)
        if w is None:
            return 1
        share = w.counts[key] / self.window  # over a full window: no prefix looks hot at start-up
        return min(partitions, max(1, math.ceil(share * partitions / self.spill_share - 1e-9)))


class Placement:
    """The (key, partition) an edge publishes a request with: by prefix affinity when the request
    has a shareable prefix and the topic's partition count is known, else keyed by its request id
    (Kafka's partitioner places it). The partition count is looked up once per topic and again
    after ``PARTITIONS_TTL_S`` (partitions can be added); a failed look-up falls back to the
    request-id key and is retried after ``PARTITIONS_RETRY_S``."""

    PARTITIONS_TTL_S = 60.0
    PARTITIONS_RETRY_S = 5.0

    def __init__(self, bus: PartitionSource, affinity: PrefixAffinity | None) -> None:
        self.bus, self.affinity = bus, affinity
        self._partitions: dict[str, tuple[int, float]] = {}  # topic -> (count, valid until, monotonic)

    async def place(self, topic: str, req: InferenceRequest) -> tuple[bytes, int | None]:
        fallback = (req.request_id.encode(), None)
        if self.affinity is None:
            return fallback
        key = prefix_key(req.tenant, req.prompt_token_ids, req.messages, self.affinity.prefix_tokens, req.lora)
        if key is None:
            return fallback
        n = await self._count(topic)
        if n < 1:
            return fallback
        return key, self.affinity.place(topic, key, n)

    async def _count(self, topic: str) -> int:
        now = time.monotonic()
        cached = self._partitions.get(topic)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            n = len(await self.bus.partitions_for(topic))
        except Exception as exc:  # the bus is down or the topic unknown: place by request id meanwhile
            log.debug("partitions of %s unknown (%s): placing by request id", topic, exc)
            self._partitions[topic] = (0, now + self.PARTITIONS_RETRY_S)
            return 0
        self._partitions[topic] = (n, now + (self.PARTITIONS_TTL_S if n else self.PARTITIONS_RETRY_S))
        return n
