"""The worker's two small bus loops beside its intake: the control reader and the heartbeat.

Each is a coroutine that runs until cancelled (the worker owns the task and cancels it in
``stop``); a bus error is logged and retried after a pause, never raised, so a broker outage does
not end them. Neither touches worker state directly: they call back (event loop only).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from bus import Bus, BusError, Cancel, Consumer, DecodeError, LoraControl, WorkerStatus, decode, encode

log = logging.getLogger(__name__)

CONTROL_POLL_MS = 500
RETRY_S = 0.5  # pause after a failed fetch


async def read_cancels(control: Consumer, on_cancel: Callable[[str], object], worker_id: str,
                       on_lora: Callable[[LoraControl], Awaitable[None]] | None = None) -> None:
    """Read the control topic and call ``on_cancel(request_id)`` for each ``Cancel`` and await
    ``on_lora(control)`` for each ``LoraControl`` (a run-time adapter load or unload); records of
    other types are ignored (the topic is shared), undecodable ones logged and skipped."""
    while True:
        try:
            records = await control.getmany(timeout_ms=CONTROL_POLL_MS)
        except BusError as exc:
            log.warning("worker %s: control fetch failed (%s)", worker_id, exc)
            await asyncio.sleep(RETRY_S)
            continue
        for rec in records:
            try:
                msg = decode(rec.value)
            except DecodeError as exc:
                log.warning("ignoring undecodable control record %s@%d: %s", rec.topic, rec.offset, exc)
                continue
            if isinstance(msg, Cancel):
                on_cancel(msg.request_id)
            elif isinstance(msg, LoraControl) and on_lora is not None:
                await on_lora(msg)


async def heartbeat(bus: Bus, topic: str, worker_id: str, status: Callable[[], WorkerStatus],
                    period_s: float, before: Callable[[], None] | None = None,
                    refresh: Callable[[], Awaitable[None]] | None = None) -> None:
    """Every ``period_s``: ``refresh()`` (the worker asks the bus for its consumer lag),
    ``before()`` (it refreshes its gauges), then ``status()`` published to ``topic`` keyed by the
    worker id (so one worker's heartbeats stay in order).

    The heartbeats are also the failover's clock (peers presume this worker dead after a few
    silent periods), so the cadence does not wait on the broker: the lag refresh gets half a period
    (a slower one goes on in the background and the heartbeat carries the previous figures), a
    send is not awaited before the next period starts (at most ``MAX_BEATS_IN_FLIGHT`` are), and
    the period is kept from one start to the next rather than added after the work."""
    loop = asyncio.get_running_loop()
    key = worker_id.encode()
    refreshing: asyncio.Future[None] | None = None
    in_flight: deque[asyncio.Future[object]] = deque()
    next_at = loop.time()
    try:
        while True:
            if refresh is not None:
                if refreshing is None or refreshing.done():
                    refreshing = asyncio.ensure_future(refresh())
                await asyncio.wait([refreshing], timeout=period_s / 2)
            if before is not None:
                before()
            while in_flight and (in_flight[0].done() or len(in_flight) >= MAX_BEATS_IN_FLIGHT):
                await _sent(in_flight.popleft(), worker_id)
            in_flight.append(asyncio.ensure_future(bus.send(topic, encode(status()), key=key)))
            next_at = max(next_at + period_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
    finally:
        for fut in (refreshing, *in_flight):
            if fut is not None:
                fut.cancel()


MAX_BEATS_IN_FLIGHT = 4


async def _sent(fut: asyncio.Future[object], worker_id: str) -> None:
    try:
        await fut
    except BusError as exc:
        log.warning("worker %s: heartbeat failed (%s)", worker_id, exc)
