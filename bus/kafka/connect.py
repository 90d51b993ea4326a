"""Connecting to a Kafka broker at start: :func:`retrying` runs a client's start attempt with
exponential backoff (0.1 s doubling to 2 s) until it succeeds or the time allowed has passed, then
raises one :class:`~bus.base.BusError` naming the bootstrap address (used by
:meth:`bus.kafka.KafkaBus.start` for its producer and admin client). While any start is retrying,
aiokafka's ERROR line for each failed bootstrap connect is dropped (:data:`BOOTSTRAP_FILTER`): the
retries log at DEBUG instead, and the last dropped line (the only place aiokafka says why: a
refused SASL login, a TLS handshake error) ends the ``BusError``'s text.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.errors import KafkaError

from bus.base import BusError

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0


class _BootstrapErrors(logging.Filter):
    """Drops aiokafka's ERROR line for each failed bootstrap connect while a start is retrying: the
    retry loop logs at DEBUG and ends in one ``BusError`` naming the address, where a broker that
    is still starting produced a dozen ERROR lines first. Installed on the ``aiokafka`` logger
    while at least one start is retrying (counted), so errors after start-up are logged as ever."""

    active = 0
    # The last line dropped: the only place aiokafka names why a bootstrap connect failed (a
    # refused SASL login, a TLS handshake error), so the final BusError can carry it.
    last_dropped: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Unable connect to \""):
            _BootstrapErrors.last_dropped = message
            return False
        return True


BOOTSTRAP_FILTER = _BootstrapErrors()


async def retrying(what: str, bootstrap: str, timeout_s: float, attempt: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``attempt`` until it succeeds or ``timeout_s`` has passed, with exponential backoff.

    ``attempt`` must clean up after itself when it fails or is cancelled."""
    deadline = time.monotonic() + timeout_s
    backoff = BACKOFF_START_S
    last: BaseException | None = None
    if _BootstrapErrors.active == 0:
        # first in line, before outage.py's repeat limiter, which would hide a repeated line from it
        logging.getLogger("aiokafka").filters.insert(0, BOOTSTRAP_FILTER)
        _BootstrapErrors.last_dropped = None
    _BootstrapErrors.active += 1
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(attempt(), left)
            except (KafkaError, OSError, TimeoutError) as exc:
                if last is None or not isinstance(exc, TimeoutError):  # the attempt cut short says least
                    last = exc
                log.debug("%s: %s unreachable (%s); retrying", what, bootstrap, exc)
            await asyncio.sleep(min(backoff, max(deadline - time.monotonic(), 0)))
            backoff = min(backoff * 2, BACKOFF_MAX_S)
    finally:
        _BootstrapErrors.active -= 1
        if _BootstrapErrors.active == 0:
            logging.getLogger("aiokafka").removeFilter(BOOTSTRAP_FILTER)
    why = f"; last connect error: {_BootstrapErrors.last_dropped}" if _BootstrapErrors.last_dropped else ""
    raise BusError(f"{what}: Kafka broker at {bootstrap} unreachable after {timeout_s:g}s ({last!r}){why}")
