"""The bounded batching OTLP/HTTP exporter: ended spans in (:meth:`OtlpExporter.offer`, sync, never
blocks), JSON batches out to ``<endpoint>/v1/traces`` from one owned background task.

Invariants: the queue holds at most ``max_queue`` spans; a span offered to a full queue is dropped
and counted (``dropped``), as is every span of a batch the receiver did not take (a tracing outage
costs traces, never requests or memory). The POST runs on a worker thread (``urllib``: stdlib,
http and https) so the event loop never waits on the receiver. ``stop`` sends what is queued,
bounded by ``timeout_s`` per batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping

from tracing.otlp import encode
from tracing.span import AttrValue, SpanRecord

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The traces URL for an OTLP/HTTP base endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``'s meaning:
    ``/v1/traces`` is appended), checked. ``ValueError`` names what is wrong."""
    e = endpoint.strip()
    if not (e.startswith("http://") or e.startswith("https://")) or len(e.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"OTLP endpoint {endpoint!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:4318)")
    return e.rstrip("/") + TRACES_PATH


class OtlpExporter:
    """See the module docstring. ``resource``: the process's resource attributes (``service.name``)."""

    def __init__(self, endpoint: str, resource: Mapping[str, AttrValue], *, max_queue: int = 4096,
                 batch: int = 512, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self.url = traces_url(endpoint)
        self.resource = dict(resource)
        self.max_queue, self.batch, self.interval_s, self.timeout_s = max_queue, batch, interval_s, timeout_s
        self._queue: deque[SpanRecord] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.exported = 0
        self.dropped = 0
        self.failed_batches = 0

    def offer(self, record: SpanRecord) -> None:
        """Queue an ended span (a :class:`~tracing.span.Tracer`'s sink)."""
        if len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append(record)
        if len(self._queue) >= self.batch and self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="otlp-exporter")

    async def stop(self) -> None:
        """Send what is still queued, then end the task. A batch the receiver fails ends the flush
        (the rest is counted as dropped): a dead receiver delays a stop by one ``timeout_s``. The
        whole stop waits at most ``2 x timeout_s``; past it the task is cancelled and what is left
        counts as dropped (a POST already on its thread may finish after that, unobserved)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        assert self._wake is not None
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timeout_s * 2)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except asyncio.CancelledError:  # our caller was cancelled: do not orphan the task
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        self.dropped += len(self._queue)
        self._queue.clear()

    async def __aenter__(self) -> OtlpExporter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            # ``_stopping`` is read before the flush, so a stop that lands during it (or before
            # this task first ran) still gets one more full flush of what is queued.
            if not self._stopping:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                except TimeoutError:
                    pass
                self._wake.clear()
            stopping = self._stopping
            while self._queue:
                if not await self._flush():
                    break  # receiver down: try again next interval (or give up when stopping)
            if stopping:
                return

    async def _flush(self) -> bool:
        n = min(len(self._queue), self.batch)
        records = [self._queue.popleft() for _ in range(n)]
        try:
            body = encode(records, self.resource)
        except Exception:  # a span that does not encode is dropped with its batch; the exporter lives on
            self.dropped += n
            log.exception("OTLP export: %d spans did not encode, dropped", n)
            return True
        try:
            await asyncio.to_thread(self._post, body)
        except Exception as exc:  # the receiver is down or refused: count, say so, go on
            self.dropped += n
            self.failed_batches += 1
            if self.failed_batches == 1 or self.failed_batches % 100 == 0:
                log.warning("OTLP export to %s failed (%s); %d spans dropped so far", self.url, exc, self.dropped)
            return False
        self.exported += n
        return True

    def _post(self, body: bytes) -> None:
        import urllib.request  # here, not at import: with tracing off nothing of it is loaded

        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            resp.read()
