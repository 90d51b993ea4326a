"""The async shell of fleet-wide limits: publishes this edge's heartbeat on ``<ns>.edges`` every
``fleet_sync_interval_s`` and feeds every heartbeat it reads (its own included) to the pure
:class:`~edge.admission.fleet.FleetLimits`. Owned by the edge: ``start()`` creates its two tasks,
``stop()`` publishes a ``gone`` heartbeat (bounded) and cancels and awaits them.

The reader starts ``stale_s`` back in time, so the heartbeats of every live edge are read before
this edge's first one comes back; then it publishes again at once, and :meth:`wait_fresh` waits for
that second one to come back (the edge's start does, bounded).
A publish that the bus does not take within the interval is dropped, not queued: the next heartbeat
carries newer values, and missing echoes are exactly what turns the view stale (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from bus import Bus, Consumer, DecodeError, EdgeStatus, TopicLayout, decode, encode
from edge.admission.fleet import MAX_KEYS_PER_STATUS, FleetLimits
from edge.admission.ratelimit import RateLimiter
from edge.admission.router import checkpoint

log = logging.getLogger(__name__)


class FleetSync:
    def __init__(self, bus: Bus, layout: TopicLayout, limiter: RateLimiter, interval_s: float,
                 publish_timeout_s: float) -> None:
        assert limiter.fleet is not None, "FleetSync needs a RateLimiter with a FleetLimits"
        self.bus = bus
        self.topic = layout.edges_topic
        self.limiter = limiter
        self.fleet: FleetLimits = limiter.fleet
        self.interval_s = interval_s
        self.publish_timeout_s = publish_timeout_s
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()  # set once fleet.ready(): the start waits for it
        self._kick = asyncio.Event()  # publish now, not after the interval (the first echo came back)
        self._warned_truncated = False

    async def start(self) -> None:
        if self._tasks:
            return
        consumer = self.bus.consumer([self.topic], group_id=None,
                                     start_from=int((time.time() - self.fleet.stale_s) * 1000))
        await consumer.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(consumer), name="edge-fleet-read"),
                       loop.create_task(self._publish(), name="edge-fleet-publish")]

    async def wait_fresh(self, timeout: float) -> bool:
        """Wait until this edge's view of the fleet is current and its shares usable: a heartbeat
        it sent after reading the others' came back (two round trips), and every other live edge
        counts it (their next heartbeat). False after ``timeout`` s (it then refuses keys with
        limits until its view is current, and has room for streams once the others count it)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        return self.fleet.fresh(time.monotonic()) and self.fleet.ready() and self.fleet.counted()

    async def stop(self) -> None:
        if not self._tasks:
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:  # tell the others our share is free now rather than after stale_s
            async with asyncio.timeout(min(1.0, self.publish_timeout_s)):
                await self.bus.send(self.topic, encode(self.fleet.leaving(time.time())),
                                    key=self.fleet.instance.encode())
        except Exception as exc:  # the others expire us after stale_s instead
            log.info("fleet limits: could not publish the leaving heartbeat: %s", exc)

    async def _publish(self) -> None:
        failing = False
        while True:
            st = self.fleet.status(self.limiter.in_flight(), time.monotonic(), time.time())
            if self.fleet.truncated and not self._warned_truncated:
                self._warned_truncated = True
                log.warning("fleet limits: more than %d keys have load at this edge; the heartbeat lists the "
                            "most loaded ones, the others get only their even share of max_streams here",
                            MAX_KEYS_PER_STATUS)
            try:
                async with asyncio.timeout(max(self.interval_s, min(self.publish_timeout_s, 2 * self.interval_s))):
                    await self.bus.send(self.topic, encode(st), key=self.fleet.instance.encode())
                if failing:
                    failing = False
                    log.info("fleet limits: heartbeats published again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no echo then: the view turns stale by itself
                if not failing:  # once per outage, not twice a second
                    failing = True
                    log.warning("fleet limits: heartbeat not published (keys with limits are refused until "
                                "heartbeats come back): %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._kick.wait()
            self._kick.clear()

    async def _read(self, consumer: Consumer) -> None:
        try:
            while True:
                records = await consumer.getmany(timeout_ms=200, max_records=1024)
                checkpoint()
                now = time.monotonic()
                for rec in records:
                    try:
                        msg = decode(rec.value)
                    except DecodeError as exc:
                        log.warning("fleet limits: undecodable heartbeat skipped: %s", exc)
                        continue
                    if isinstance(msg, EdgeStatus):
                        self.fleet.observe(msg, now)
                        if msg.edge_id == self.fleet.instance and not self.fleet.ready():
                            self._kick.set()  # the first echo: the view is complete, say so at once
                if not self._ready.is_set() and self.fleet.ready() and self.fleet.counted():
                    self._ready.set()
        finally:
            await consumer.stop()
