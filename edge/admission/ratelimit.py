"""Per-key rate limits: token buckets for requests/min and tokens/min, a counter for concurrent
streams. Pure and synchronous: callers pass ``now`` (monotonic seconds), so tests need no clock.

A request is charged ``prompt_tokens + max_tokens`` tokens when admitted (the most it can cost);
:meth:`KeyLimiter.release` refunds what it did not generate and frees its stream slot. A rejection
carries ``retry_after``: the seconds after which the same request would be admitted if nothing else
happened. Buckets start full, so a fresh key may burst one minute's worth.

Not thread-safe; one event loop owns a :class:`RateLimiter`.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge.config import KeyEntry


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` tokens/s. ``rate == 0`` is unlimited."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are available (0 = now). Never takes anything."""
        if self.rate == 0:
            return 0.0
        self._refill(now)
        if self.level >= n:
            return 0.0
        return (n - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        if self.rate == 0:
            return
        self._refill(now)
        self.level -= n

    def give(self, n: float, now: float) -> None:
        if self.rate == 0:
            return
        self._refill(now)
        self.level = min(self.capacity, self.level + n)


@dataclass(frozen=True, slots=True)
class Limited:
    """Why a request was refused: ``field`` is the limit's name in the key file."""

    field: str
    message: str
    retry_after: float | None  # None: waiting will not help (request larger than the limit)


class KeyLimiter:
    """The state of one API key."""

    __slots__ = ("entry", "requests", "tokens", "streams")

    def __init__(self, entry: KeyEntry, now: float) -> None:
        self.entry = entry
        self.requests = TokenBucket(entry.requests_per_min, now)
        self.tokens = TokenBucket(entry.tokens_per_min, now)
        self.streams = 0

    def admit(self, cost_tokens: int, now: float) -> Limited | None:
        """Charge one request of ``cost_tokens`` and take a stream slot, or say why not (no charge)."""
        e = self.entry
        if e.max_streams and self.streams >= e.max_streams:
            return Limited("max_streams", f"{self.streams} streams in flight, the key allows {e.max_streams}", 1.0)
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
    come from the key file, or one shared ``dev`` entry in dev mode)."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyLimiter] = {}

    def limiter(self, entry: KeyEntry, now: float) -> KeyLimiter:
        lim = self._keys.get(entry.key_hash)
        if lim is None or lim.entry != entry:
            lim = self._keys[entry.key_hash] = KeyLimiter(entry, now)
        return lim

    def admit(self, entry: KeyEntry, cost_tokens: int, now: float) -> Limited | None:
        return self.limiter(entry, now).admit(cost_tokens, now)

    def release(self, entry: KeyEntry, refund_tokens: int, now: float) -> None:
        lim = self._keys.get(entry.key_hash)
        if lim is not None:
            lim.release(refund_tokens, now)
