"""The worker's two small bus loops beside its intake: the control reader and the heartbeat.

Each is a coroutine that runs until cancelled (the worker owns the task and cancels it in
``stop``); a bus error is logged and retried after a pause, never raised, so a broker outage does
not end them. Neither touches worker state directly: they call back (event loop only).
"""

from __future__ import annotations

import asyncio
import logging
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
    """Every ``period_s``: ``await refresh()`` (the worker asks the bus for its consumer lag),
    ``before()`` (it refreshes its gauges), then ``status()`` published to ``topic`` keyed by the
    worker id (so one worker's heartbeats stay in order)."""
    key = worker_id.encode()
    while True:
        if refresh is not None:
            await refresh()
        if before is not None:
            before()
        try:
            await bus.send(topic, encode(status()), key=key)
        except BusError as exc:
            log.warning("worker %s: heartbeat failed (%s)", worker_id, exc)
        await asyncio.sleep(period_s)
