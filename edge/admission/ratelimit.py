"""Per-key rate limits: token buckets for requests/min and tokens/min, a counter for concurrent
streams. Pure and synchronous: callers pass ``now`` (monotonic seconds), so tests need no clock.

A request is charged ``prompt_tokens + max_tokens`` tokens when admitted (the most it can cost);
:meth:`KeyLimiter.release` refunds what it did not generate and frees its stream slot. A rejection
carries ``retry_after``: the seconds after which the same request would be admitted if nothing else
happened. Buckets start full, so a fresh key may burst one minute's worth.

With fleet-wide limits (:mod:`edge.admission.fleet`) each bucket holds this edge's share of the
key's limit and ``max_streams`` is this edge's allocation; without, each edge enforces the whole.

Not thread-safe; one event loop owns a :class:`RateLimiter`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from edge.admission.fleet import FleetLimits, Share, limited
from edge.config import KeyEntry


class TokenBucket:
    """``per_minute`` tokens a minute (``0`` = unlimited), of which this edge holds ``share``: its
    capacity is ``share * per_minute`` tokens, refilled at ``share * per_minute / 60`` tokens/s."""

    __slots__ = ("per_minute", "share", "capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float, share: float = 1.0) -> None:
        self.per_minute = per_minute
        self.share = share
        self.capacity = per_minute * share
        self.rate = self.capacity / 60.0
        self.level = self.capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def rescale(self, share: float, now: float) -> None:
        """Hold ``share`` of the limit from now on. The level never jumps up (a larger share only
        refills faster) and is cut to a smaller capacity, so the edges' buckets together never
        hold more than the key's one bucket would."""
        if share == self.share or self.per_minute == 0:
            return
        self._refill(now)
        self.share = share
        self.capacity = self.per_minute * share
        self.rate = self.capacity / 60.0
        self.level = min(self.level, self.capacity)

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are available (0 = now). Never takes anything. A request
        larger than this edge's capacity (a small share of the limit) passes when the bucket is
        full and leaves it in debt, so the long-run rate still holds."""
        if self.per_minute == 0:
            return 0.0
        self._refill(now)
        need = min(n, self.capacity)
        if self.level >= need and self.capacity > 0:
            return 0.0
        if self.rate == 0:
            return math.inf
        return (need - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        if self.per_minute == 0:
            return
        self._refill(now)
        self.level -= n

    def give(self, n: float, now: float) -> None:
        if self.per_minute == 0:
            return
        self._refill(now)
        self.level = min(self.capacity, self.level + n)


@dataclass(frozen=True, slots=True)
class Limited:
    """Why a request was refused: ``field`` is the limit's name in the key file."""

    field: str
    message: str
    retry_after: float | None  # None: waiting will not help (request larger than the limit)
    overloaded: bool = False  # not the key's fault: the edge cannot see the fleet (HTTP 503, not 429)


class KeyLimiter:
    """The state of one API key."""

    __slots__ = ("entry", "requests", "tokens", "streams")

    def __init__(self, entry: KeyEntry, now: float, share: float = 1.0) -> None:
        self.entry = entry
        self.requests = TokenBucket(entry.requests_per_min, now, share)
        self.tokens = TokenBucket(entry.tokens_per_min, now, share)
        self.streams = 0

    def admit(self, cost_tokens: int, now: float, share: Share | None = None) -> Limited | None:
        """Charge one request of ``cost_tokens`` and take a stream slot, or say why not (no charge).
        ``share``: this edge's part of the key's limits (fleet-wide limits); None = all of them."""
        e = self.entry
        if share is not None:
            self.requests.rescale(share.rate, now)
            self.tokens.rescale(share.rate, now)
        cap = e.max_streams if share is None or share.streams is None else share.streams
        if e.max_streams and self.streams >= cap:
            if cap == e.max_streams:
                return Limited("max_streams", f"{self.streams} streams in flight, the key allows {e.max_streams}", 1.0)
            return Limited("max_streams", f"the key's {e.max_streams} streams are in flight or held by other edges "
                           f"({self.streams} at this one)", 1.0)
        if e.tokens_per_min and cost_tokens > e.tokens_per_min:
            return Limited(
                "tokens_per_min",
                f"the request may use {cost_tokens} tokens (prompt + max_tokens), the key allows "
                f"{e.tokens_per_min}/min: lower max_tokens",
                None,
            )
        wait_r = self.requests.wait_for(1, now)
        if wait_r > 0:
            return Limited("requests_per_min", f"over {e.requests_per_min} requests/min", _ceil(wait_r))
        wait_t = self.tokens.wait_for(cost_tokens, now)
        if wait_t > 0:
            return Limited("tokens_per_min", f"over {e.tokens_per_min} tokens/min", _ceil(wait_t))
        self.requests.take(1, now)
        self.tokens.take(cost_tokens, now)
        self.streams += 1
        return None

    def release(self, refund_tokens: int, now: float) -> None:
        """A stream ended: free its slot and refund the tokens it was charged but did not use."""
        self.streams = max(0, self.streams - 1)
        if refund_tokens > 0:
            self.tokens.give(refund_tokens, now)


def _ceil(seconds: float) -> float:
    """Round ``retry_after`` up to 10 ms so a client that waits exactly that long gets in."""
    return max(0.01, -(-seconds // 0.01) * 0.01)


class RateLimiter:
    """All keys' limiters, created on first use. Memory: one small object per key ever seen (keys
    come from the key file, or one shared ``dev`` entry in dev mode). With ``fleet`` each key's
    limits are shared with the other edges (:mod:`edge.admission.fleet`)."""

    def __init__(self, fleet: FleetLimits | None = None) -> None:
        self._keys: dict[str, KeyLimiter] = {}
        self.fleet = fleet

    def limiter(self, entry: KeyEntry, now: float) -> KeyLimiter:
        lim = self._keys.get(entry.key_hash)
        if lim is None or lim.entry != entry:
            lim = self._keys[entry.key_hash] = KeyLimiter(entry, now)
        return lim

    def admit(self, entry: KeyEntry, cost_tokens: int, now: float) -> Limited | None:
        fleet = self.fleet
        if fleet is None or not limited(entry):
            return self.limiter(entry, now).admit(cost_tokens, now)
        if not fleet.fresh(now):
            # fail closed: without a current view another edge may be using this key's whole limit
            return Limited("fleet_limits", "this edge cannot see the other edges' use of the key's limits "
                           "(the bus is slow or unreachable); try again shortly", fleet.stale_s, overloaded=True)
        share = fleet.share(entry, now)
        lim = self._keys.get(entry.key_hash)
        if lim is None or lim.entry != entry:
            lim = self._keys[entry.key_hash] = KeyLimiter(entry, now, share.rate)
        out = lim.admit(cost_tokens, now, share)
        fleet.attempted(entry.key_hash, out.field if out is not None else None, now)
        return out

    def in_flight(self) -> Mapping[str, int]:
        """Streams in flight per key hash, for the keys that have some (the fleet heartbeat)."""
        return {h: lim.streams for h, lim in self._keys.items() if lim.streams}

    def release(self, entry: KeyEntry, refund_tokens: int, now: float) -> None:
        lim = self._keys.get(entry.key_hash)
        if lim is not None:
            lim.release(refund_tokens, now)
