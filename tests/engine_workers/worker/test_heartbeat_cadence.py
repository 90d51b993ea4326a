"""The heartbeat loop keeps its cadence when the broker is slow: the heartbeats are the failover's
clock (peers presume a worker dead after a few silent periods), so neither a slow lag refresh nor a
slow send acknowledgement may stretch the period."""

from __future__ import annotations

import asyncio

from bus import WorkerStatus
from engine_workers.worker.loops import MAX_BEATS_IN_FLIGHT, heartbeat


class SlowBus:
    """Acknowledges each send after ``ack_s``; records when each send started."""

    def __init__(self, ack_s: float) -> None:
        self.ack_s = ack_s
        self.started: list[float] = []
        self.in_flight = self.most_in_flight = 0

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.started.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.ack_s)
        finally:
            self.in_flight -= 1


async def test_slow_refresh_and_slow_acks_do_not_stretch_the_period() -> None:
    period = 0.05
    bus = SlowBus(ack_s=10 * period)
    refreshes = 0

    async def slow_refresh() -> None:
        nonlocal refreshes
        refreshes += 1
        await asyncio.sleep(20 * period)

    task = asyncio.ensure_future(heartbeat(bus, "status", "w", lambda: WorkerStatus("w", "m", 0.0), period,  # type: ignore[arg-type]
                                           refresh=slow_refresh))
    await asyncio.sleep(12 * period)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    # Awaiting each refresh and ack in turn would have sent one heartbeat in this time. Loose
    # bound: a loaded machine delays the sleeps too.
    assert len(bus.started) >= 4, bus.started
    assert refreshes == 1  # a slow refresh is not started again while it runs
    assert bus.most_in_flight <= MAX_BEATS_IN_FLIGHT  # bounded
