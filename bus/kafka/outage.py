"""How the Kafka clients behave while no broker answers: a backoff for aiokafka's metadata
refresh, and a limit on the log lines it repeats.

aiokafka (0.14) refreshes cluster metadata in one task per client (``_md_synchronizer``), woken by
``force_metadata_update()``. Its producer's sender calls that in a loop, without a pause, for as
long as a partition with queued records has no known leader, and a refresh against a cluster that
refuses connections fails within a millisecond. A broker that shuts down cleanly (a restart, a
rolling upgrade) leaves exactly that state behind: its last metadata names no leader for the
partitions it led. So a worker whose broker stops cleanly spins: thousands of refreshes and ERROR
lines a second, and the worker's event loop, which shares the machine with the engine, busy for
the whole outage (figures in docs/bus.md, A broker outage). A broker killed outright leaves the
leaders in place and does not trigger it.

* :func:`throttle_metadata_refresh` wraps one client's refresh: after a failed refresh the next
  one waits, 0.1 s doubling to 1 s, reset by the first success. Callers that await the refresh
  wait with it (they would otherwise spin); at most ``max_s`` is added to noticing a broker that
  is back. It replaces a private method on the instance (the only hook there is); if aiokafka
  renames it, :func:`throttle_metadata_refresh` raises, and the Kafka tests say so.
* :class:`RepeatLimiter`, on every ``aiokafka`` logger (:func:`limit_repeated_logs`): with the
  refreshes throttled, the fetcher's and the connection's own retries still log ERROR lines
  several times a second per process. Each message (logger and format string) is let through once per
  ``window_s``; the next one let through says how many were dropped meanwhile.

With both, an outage costs the worker little CPU and a handful of log lines, and every reply
stream stays exact (``docs/bus.md``, A broker outage, has the figures).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

START_S = 0.1
MAX_S = 1.0


class MetadataBackoff:
    """The wait before a client's next metadata refresh. Sans-I/O: the caller passes the time."""

    __slots__ = ("start_s", "max_s", "failures", "failed_at")

    def __init__(self, start_s: float = START_S, max_s: float = MAX_S) -> None:
        if not 0 < start_s <= max_s:
            raise ValueError(f"need 0 < start_s <= max_s, got {start_s}, {max_s}")
        self.start_s = start_s
        self.max_s = max_s
        self.failures = 0  # refreshes failed in a row
        self.failed_at = 0.0

    def delay(self, now: float) -> float:
        """Seconds to wait at ``now`` before refreshing (0 after a success)."""
        if not self.failures:
            return 0.0
        # the exponent capped: an outage of hours counts thousands of failures, and 0.1 * 2**1100
        # overflows a float (the refresh task would die with the error)
        wait = min(self.max_s, self.start_s * 2 ** min(self.failures - 1, 30))
        return max(0.0, self.failed_at + wait - now)

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures = 0
        else:
            self.failures += 1
            self.failed_at = now


def throttle_metadata_refresh(client: Any, start_s: float = START_S, max_s: float = MAX_S) -> MetadataBackoff:
    """Make ``client`` (an ``aiokafka.client.AIOKafkaClient``, before its ``bootstrap``) wait
    between failed metadata refreshes. Returns the backoff state (tests read it). Cancellation: a
    cancelled wait cancels the refresh, as cancelling aiokafka's own task would."""
    refresh = getattr(client, "_metadata_update", None)
    if refresh is None or not asyncio.iscoroutinefunction(refresh):
        raise RuntimeError("aiokafka's AIOKafkaClient has no _metadata_update coroutine to throttle "
                           "(renamed in this aiokafka version?)")
    backoff = MetadataBackoff(start_s, max_s)

    async def throttled(cluster_metadata: Any, topics: Any) -> bool:
        loop = asyncio.get_running_loop()
        wait = backoff.delay(loop.time())
        if wait > 0:
            await asyncio.sleep(wait)
        ok = bool(await refresh(cluster_metadata, topics))
        if not ok and backoff.failures == 0:
            log.debug("metadata refresh failed; backing off %.1f-%.1f s between refreshes", start_s, max_s)
        backoff.record(ok, loop.time())
        return ok

    client._metadata_update = throttled  # shadows the method for this instance only
    return backoff


class RepeatLimiter(logging.Filter):
    """Lets each (logger, format string) through at most once per ``window_s``; the record let
    through after drops says how many. Records below WARNING always pass. Thread-safe enough for
    logging's purposes (a race can let one extra line through, never lose the count's meaning).
    Memory: at most ``max_keys`` messages remembered (then forgotten all at once)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 1000) -> None:
        super().__init__()
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self.max_keys = max_keys
        self._seen: dict[tuple[str, str], list] = {}  # key -> [last let through at, dropped since]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.window_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            # appended to the format string: no '%' of ours may reach the formatting
            record.msg = f"{record.msg} [{seen[1]} more like this in the last {now - seen[0]:.0f}s not logged]"
        if len(self._seen) >= self.max_keys:
            self._seen.clear()
        self._seen[key] = [now, 0]
        return True


_LIMITER: RepeatLimiter | None = None


def limit_repeated_logs() -> RepeatLimiter:
    """Install one :class:`RepeatLimiter` on every ``aiokafka`` logger (a filter on a logger sees
    only the records logged to it, not its children's). Idempotent; later calls add it to loggers
    created since."""
    global _LIMITER
    if _LIMITER is None:
        _LIMITER = RepeatLimiter()
    names = ["aiokafka", *(n for n in list(logging.Logger.manager.loggerDict) if n.startswith("aiokafka."))]
    for name in names:
        logger = logging.getLogger(name)
        if _LIMITER not in logger.filters:
            logger.addFilter(_LIMITER)
    return _LIMITER
