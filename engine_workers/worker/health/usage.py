"""Per-tenant usage: Prometheus counters labelled by tenant, and the billing log.

For every request the engine ran to a ``Finished`` (not one cancelled before it ran, nor one
answered with an ``Error``), once that final reply is acknowledged: the tenant's counters move
(``lockgate:tenant_prompt_tokens_total``, ``..._completion_tokens_total``, ``..._cached_tokens_total``,
labels ``model``, ``tenant``) and a :class:`~bus.messages.UsageRecord` is queued for ``<ns>.usage``
(keyed by tenant). Sending never delays a reply or the intake: records go out from a task of their
own, several at a time; a record whose send failed ``SEND_ATTEMPTS`` times is logged and counted
(``lockgate:usage_send_failures_total``) and dropped, and so is the oldest record when
``max_pending`` are waiting (a bus down for long). At least once, mostly: a request re-run after a
crash may be recorded twice (deduplicate by ``request_id``); one finished in the moment before a
crash may be missed.

Concurrency: event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter

from bus import Bus, Finished, InferenceRequest, UsageRecord, encode

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 3
RETRY_BACKOFF_S = (0.1, 0.5)  # between attempts
MAX_IN_FLIGHT = 32


class UsageLog:
    def __init__(self, bus: Bus, topic: str, registry: CollectorRegistry, model: str, worker_id: str,
                 max_pending: int = 10_000) -> None:
        self.bus, self.topic, self.model, self.worker_id = bus, topic, model, worker_id
        self.max_pending = max_pending
        mt = ["model", "tenant"]
        self.prompt_tokens = Counter("lockgate:tenant_prompt_tokens", "Prompt tokens of finished requests, per tenant.",
                                     mt, registry=registry)
        self.completion_tokens = Counter("lockgate:tenant_completion_tokens",
                                         "Generated tokens of finished requests, per tenant.", mt, registry=registry)
        self.cached_tokens = Counter("lockgate:tenant_cached_tokens",
                                     "Prompt tokens of finished requests found in the prefix cache, per tenant.", mt,
                                     registry=registry)
        self.send_failures = Counter("lockgate:usage_send_failures",
                                     "Usage records that could not be sent to the usage topic (dropped).",
                                     registry=registry)
        self._pending: deque[UsageRecord] = deque()
        self._task: asyncio.Task | None = None
        self._in_flight: set[asyncio.Task] = set()
        self.sent = 0

    def record(self, req: InferenceRequest, fin: Finished) -> None:
        """``req`` finished with ``fin`` (its final reply acknowledged): count it and queue its record."""
        u = fin.usage
        labels = (self.model, req.tenant)
        self.prompt_tokens.labels(*labels).inc(u.prompt_tokens)
        self.completion_tokens.labels(*labels).inc(u.completion_tokens)
        self.cached_tokens.labels(*labels).inc(u.cached_tokens)
        if len(self._pending) >= self.max_pending:
            lost = self._pending.popleft()
            self.send_failures.inc()
            log.warning("worker %s: usage log backlog full (%d); dropped the record of %s", self.worker_id,
                        self.max_pending, lost.request_id)
        self._pending.append(UsageRecord(req.request_id, req.tenant, req.model, req.tier, u.prompt_tokens,
                                         u.completion_tokens, u.cached_tokens, time.time(), fin.finish_reason,
                                         req.attempt, self.worker_id, req.lora))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump(), name=f"{self.worker_id}-usage")

    async def _pump(self) -> None:
        while self._pending:
            while self._pending and len(self._in_flight) < MAX_IN_FLIGHT:
                t = asyncio.get_running_loop().create_task(self._send(self._pending.popleft()))
                self._in_flight.add(t)
                t.add_done_callback(self._in_flight.discard)
            if self._in_flight:
                await asyncio.wait(set(self._in_flight), return_when=asyncio.FIRST_COMPLETED)

    async def _send(self, rec: UsageRecord) -> None:
        value = encode(rec)
        for attempt in range(SEND_ATTEMPTS):
            try:
                await self.bus.send(self.topic, value, key=rec.tenant.encode())
                self.sent += 1
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any bus failure: logged and counted, never raised into the worker
                if attempt + 1 == SEND_ATTEMPTS:
                    self.send_failures.inc()
                    log.warning("worker %s: usage record of %s not sent to %s after %d attempts: %s",
                                self.worker_id, rec.request_id, self.topic, SEND_ATTEMPTS, exc)
                    return
                await asyncio.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])

    def idle(self) -> bool:
        return not self._pending and not self._in_flight

    async def stop(self, grace_s: float) -> None:
        """Send what is queued for up to ``grace_s``, then give the rest up (counted as failures)."""
        tasks = [t for t in (self._task, *self._in_flight) if t is not None and not t.done()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if unsent := sum(1 for t in late if t is not self._task):
                self.send_failures.inc(unsent)
        if self._pending:
            self.send_failures.inc(len(self._pending))
            log.warning("worker %s: stopping with %d usage records unsent", self.worker_id, len(self._pending))
            self._pending.clear()
