"""bus.kafka.outage without a broker: the refresh backoff's schedule, the throttle around a client's
refresh, and the repeat limiter on log lines. (The whole of it against a stopped and restarted
broker: tests/engine_workers/worker/test_worker_kafka.py.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from bus.kafka.outage import (
    MetadataBackoff,
    RepeatLimiter,
    limit_repeated_logs,
    throttle_metadata_refresh,
)


def test_backoff_doubles_to_its_cap_and_a_success_resets_it() -> None:
    b = MetadataBackoff(0.1, 1.0)
    assert b.delay(0.0) == 0.0  # nothing failed: refresh at once
    waits = []
    for i in range(6):
        b.record(False, now=10.0 * i)
        waits.append(b.delay(10.0 * i))
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert b.delay(50.0 + 0.25) == pytest.approx(0.75)  # the wait runs from the failure
    assert b.delay(52.0) == 0.0
    for _ in range(5000):  # an outage of hours: the wait stays at its cap, no overflow
        b.record(False, now=60.0)
    assert b.delay(60.0) == 1.0
    b.record(True, now=53.0)
    assert b.delay(53.0) == 0.0 and b.failures == 0
    with pytest.raises(ValueError, match="start_s"):
        MetadataBackoff(0.5, 0.1)


class _Client:
    """Stands in for aiokafka's client: a refresh that fails ``fail`` times, then succeeds."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: list[float] = []

    async def _metadata_update(self, cluster, topics) -> bool:
        self.calls.append(asyncio.get_running_loop().time())
        return len(self.calls) > self.fail


async def test_throttled_refresh_waits_after_failures_not_after_success() -> None:
    c = _Client(fail=4)
    backoff = throttle_metadata_refresh(c, start_s=0.02, max_s=0.05)
    results = [await c._metadata_update(None, set()) for _ in range(6)]
    assert results == [False, False, False, False, True, True]
    gaps = [b - a for a, b in zip(c.calls, c.calls[1:])]
    # after each failure: 0.02, 0.04, 0.05 (capped), 0.05; after the success: no wait
    for gap, want in zip(gaps, (0.02, 0.04, 0.05, 0.05)):
        assert gap >= want * 0.9
    assert gaps[4] < 0.02 and backoff.failures == 0


def test_throttle_needs_aiokafkas_refresh_method() -> None:
    with pytest.raises(RuntimeError, match="_metadata_update"):
        throttle_metadata_refresh(object())
    from aiokafka.client import AIOKafkaClient

    # the aiokafka installed here still has the method this hooks (if a release renames it, this says so)
    assert asyncio.iscoroutinefunction(AIOKafkaClient._metadata_update)


def test_repeat_limiter_lets_one_through_per_window_and_counts_the_rest() -> None:
    now = [0.0]
    lim = RepeatLimiter(window_s=5.0, clock=lambda: now[0])
    log = logging.getLogger("tests.repeat-limiter")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    log.addHandler(handler)
    log.addFilter(lim)
    log.propagate = False
    log.setLevel(logging.DEBUG)
    try:
        for i in range(100):  # 100 failures within a second: one line
            now[0] = i / 100
            log.error("Unable connect to node with id %s: %s", 0, "refused")
        log.error("another message %s", 1)  # a different format string is not held back
        log.info("below WARNING %s", 1)  # always passes
        log.info("below WARNING %s", 2)
        now[0] = 6.0
        log.error("Unable connect to node with id %s: %s", 0, "refused")
    finally:
        log.removeHandler(handler)
        log.removeFilter(lim)
        log.propagate = True
        log.setLevel(logging.NOTSET)
    assert seen == ["Unable connect to node with id 0: refused", "another message 1", "below WARNING 1",
                    "below WARNING 2",
                    "Unable connect to node with id 0: refused [99 more like this in the last 6s not logged]"]


def test_limiter_sits_on_every_aiokafka_logger() -> None:
    import aiokafka.consumer.fetcher  # noqa: F401 - its logger exists once imported

    lim = limit_repeated_logs()
    assert limit_repeated_logs() is lim  # idempotent: one limiter
    for name in ("aiokafka", "aiokafka.consumer.fetcher", "aiokafka.producer.sender"):
        assert logging.getLogger(name).filters.count(lim) == 1, name
