"""The worker actor: one per engine. Bus records in, engine work, reply streams out.

A thin asyncio shell around the stages ``wiring.wire`` builds from the one :class:`WorkerConfig`
(``docs/worker.md`` walks through them). The actor owns the lifecycle and the background tasks:

* **intake** — a consumer in group ``<ns>.workers.<model>`` reads the model's three priority
  topics; each fetched record enters the pipeline at its first stage and walks it one way
  (``pipeline/``: decode -> reply gate -> resume -> intake checks -> intake queue -> engine
  admission); after each fetch the admission admits (so a fetch's requests are chosen among by
  priority) and the ledger commits at most every ``commit_interval_s``.
* **replies** — the engine's per-step outputs go to the way back (``replies/``); a failed send is
  re-run, answered or dead-lettered by ``pipeline/failures.py`` in a task owned here.
* **control** — ``Cancel`` aborts the request wherever it is (``aborts``); ``LoraControl`` loads
  or unloads an adapter at run time (``lora_control``);
  **heartbeat** — ``WorkerStatus`` every ``heartbeat_s`` (``loops``); ``/healthz``/``/readyz``/
  ``/metrics`` (``health``).

Lifecycle: ``start``/``stop`` idempotent, ``async with``; ``drain()`` stops intake, lets what the
engine holds finish (up to ``drain_grace_s``), commits it and stops; requests still queued stay
uncommitted for the other workers. Every background task is owned and cancelled by ``stop``.
Concurrency: all state lives on the event loop; the engine's torch thread only reaches it through
``call_soon_threadsafe`` (AsyncEngine's ``on_outputs`` and the admission futures).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from bus import Bus, BusError, Consumer, PartitionHold, WorkerStatus, encode
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.core import Engine
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.health.metrics import CONTENT_TYPE
from engine_workers.worker.health.server import HealthServer
from engine_workers.worker.loops import heartbeat, read_cancels
from engine_workers.worker.lora_control import LoraControls
from engine_workers.worker.wiring import wire
from tracing import Tracer

log = logging.getLogger(__name__)

POLL_MS = 50
STOP_COMMIT_S = 5.0
# A heartbeat's partition holds reach this far behind the oldest request held: records not fetched
# yet and producer clocks behind ours (a survivor reads a little more and finds those answered).
HOLD_SLACK_S = 2.0
LEAVE_BEAT_S = 1.0  # the last heartbeat, "leaving" (a clean stop is not a death), is tried this long


class Worker:
    """See the module docstring. ``engine``: an :class:`Engine` (the worker wraps and owns an
    :class:`AsyncEngine`) or an :class:`AsyncEngine` (started if needed, never stopped here).

    ``before_step``: called on the engine's torch thread right before each engine step (the
    :class:`AsyncEngine` hook of that name; installed on a given AsyncEngine until :meth:`stop`).
    For tests that need the step loop paced or slowed (``lambda: time.sleep(0.02)``) without
    replacing ``engine.step``; None (the default) in production.

    ``tracer``: spans per request, children of the edge's (``worker/spans.py``); None (the
    default): tracing off, no span built."""

    def __init__(self, config: WorkerConfig, bus: Bus, engine: Engine | AsyncEngine, *,
                 before_step: Callable[[], None] | None = None, tracer: Tracer | None = None) -> None:
        self.config = config
        self.bus = bus
        if isinstance(engine, AsyncEngine):
            self.aengine, self._owns_engine = engine, False
            if before_step is not None:
                engine.before_step = before_step
        else:
            self.aengine, self._owns_engine = AsyncEngine(engine, before_step=before_step), True
        self._before_step = before_step
        self.stages = wire(config, bus, self.aengine, tracer)
        self.aengine.on_outputs = self.stages.engine_stepped
        self.metrics = self.stages.metrics  # what /metrics renders (and the CLI exports)
        self._consumer: Consumer | None = None
        self._control: Consumer | None = None
        self._health: HealthServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._lag: tuple[int, ...] = (0, 0, 0)
        self._drain_requested = asyncio.Event()
        self.state = "new"  # new -> started -> draining -> stopped

    @property
    def _topics(self) -> tuple[str, ...]:
        return tuple(self.config.layout.request_topics(self.config.model))

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.state != "new":
            return
        self.state = "starting"
        st = self.stages
        try:
            await self.aengine.start()
            await self.bus.ensure_topics(self.config.layout.model_specs(self.config.model))
            self._control = self.bus.consumer([self.config.layout.control_topic], start_from="latest")
            await self._control.start()
            self._consumer = self.bus.consumer(list(self._topics), group_id=self.config.group, start_from="earliest",
                                               on_assigned=st.aborts.on_assigned, on_revoked=st.aborts.on_revoked)
            st.ledger.consumer = self._consumer
            await self._consumer.start()
            if st.takeover is not None:
                await st.takeover.start()
            if self.config.metrics_port is not None:
                self._health = HealthServer(self.config.metrics_host, self.config.metrics_port, live=self.live,
                                            ready=self.ready, metrics=self.render_metrics, metrics_content_type=CONTENT_TYPE)
                await self._health.start()
        except BaseException:
            await self.stop()
            raise
        self.state = "started"
        st.serving.on = True
        cfg = self.config
        loras = LoraControls(self.aengine.engine, self.bus, cfg.model, cfg.worker_id)
        for name, coro in (("intake", self._intake_loop()),
                           ("send-failures", st.pipeline.failures.run()),
                           ("control", read_cancels(self._control, self.cancel, cfg.worker_id, loras.handle)),
                           ("heartbeat", heartbeat(self.bus, cfg.layout.status_topic, cfg.worker_id, self.status,
                                                   cfg.heartbeat_s, before=st.observe, refresh=self._refresh_lag)),
                           # a crashed step loop (say a tensor-parallel rank died) ends run(): the
                           # worker stops uncommitted and exits non-zero, its requests resume elsewhere
                           ("engine", self.aengine.crashed())):
            self._tasks.append(asyncio.create_task(coro, name=f"{self.config.worker_id}-{name}"))
        policy = st.pipeline.admission.policy
        log.info("worker %s serving %s (group %s, intake %s, aging period %gs)", self.config.worker_id,
                 self.config.model, self.config.group, policy.mode.value, policy.aging_period_s)

    async def stop(self) -> None:
        """Stop now: commit what is finished, leave the group without committing unfinished work.
        Idempotent. The commit is bounded by ``STOP_COMMIT_S``: a broken bus must not hold the stop."""
        if self.state == "stopped":
            return
        was, self.state = self.state, "stopped"
        self.stages.serving.on = False
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.stages.takeover is not None:
            await self.stages.takeover.stop()
        if was in ("started", "draining") and self.aengine.error is None:
            # Not after an engine crash (a tensor-parallel rank died): no "leaving" beat, so the
            # peers see silence, presume this worker dead and take its requests over on the
            # failover's fast path; the group's rebalance its leaving starts finds them claimed.
            await self._leave_beat()
        # Held lookups and re-runs waiting stay uncommitted; a dead letter acknowledged finishes
        # its offset: all before the commit.
        await self.stages.pipeline.stop(STOP_COMMIT_S)
        if was in ("started", "draining"):
            # Work finished since the intake loop's last periodic commit: without this a clean
            # stop would leave up to commit_interval_s of it to be re-run by the next owner.
            try:
                await asyncio.wait_for(self.stages.ledger.commit(), STOP_COMMIT_S)
            except TimeoutError:
                log.warning("worker %s: final commit timed out after %gs; the next owner re-runs that work",
                            self.config.worker_id, STOP_COMMIT_S)
        await self.stages.way_back.stop(STOP_COMMIT_S)
        for c in (self._consumer, self._control):
            if c is not None:
                await c.stop()
        if self._health is not None:
            await self._health.stop()
        if self._owns_engine:
            await self.aengine.stop()
        elif self.aengine.on_outputs == self.stages.engine_stepped:
            self.aengine.on_outputs = None
            self.aengine.on_step = None
            if self._before_step is not None and self.aengine.before_step is self._before_step:
                self.aengine.before_step = None

    async def _leave_beat(self) -> None:
        """A last heartbeat saying ``draining``: peers forget this worker instead of presuming it
        dead and taking over what it leaves (the group rebalances at once when it leaves)."""
        try:
            status = replace(self.status(), draining=True)
            await asyncio.wait_for(self.bus.send(self.config.layout.status_topic, encode(status),
                                                 key=self.config.worker_id.encode()), LEAVE_BEAT_S)
        except (BusError, TimeoutError) as exc:
            log.warning("worker %s: last heartbeat not sent (%s)", self.config.worker_id, exc)

    async def drain(self, grace_s: float | None = None) -> bool:
        """SIGTERM path: stop taking work, finish what the engine holds (up to ``grace_s``, default
        the config's), commit it, then :meth:`stop`. Queued requests are left uncommitted for the
        other workers. Returns True when everything admitted finished in time."""
        if self.state != "started":
            await self.stop()
            return True
        self.state = "draining"
        self.stages.serving.on = False
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self.stages.pipeline.admission.drop_queued()
        ledger = self.stages.ledger
        deadline = time.monotonic() + grace
        while ledger.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        done = not ledger.busy()
        await ledger.commit()
        log.info("worker %s drained (%s)", self.config.worker_id, "complete" if done else f"grace {grace:g}s over")
        await self.stop()
        return done

    def request_drain(self) -> None:
        """Signal-handler safe: ask :meth:`run` to drain."""
        self._drain_requested.set()

    async def run(self) -> int:
        """Serve until :meth:`request_drain` (then drain) or a background failure. 0 = clean."""
        waiter = asyncio.ensure_future(self._drain_requested.wait())
        try:
            await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not self.live():
            log.error("worker %s failed; stopping", self.config.worker_id)
            await self.stop()
            return 1
        await self.drain()
        return 0

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def live(self) -> bool:
        return self.aengine.error is None and self.state != "stopped" and not any(t.done() for t in self._tasks)

    def ready(self) -> bool:
        return self.state == "started" and self.live() and bool(self._consumer and self._consumer.assignment())

    def render_metrics(self) -> bytes:
        self.stages.observe()
        return self.metrics.render()

    # -- intake -----------------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        """Fetch, hand each record to the pipeline's first stage, admit, commit now and then."""
        assert self._consumer is not None
        admission, decode, ledger = self.stages.pipeline.admission, self.stages.pipeline.decode, self.stages.ledger
        topics = self._topics
        last_commit = time.monotonic()
        while True:
            admission.flow_control(self._consumer, topics)
            try:
                records = await self._consumer.getmany(timeout_ms=POLL_MS, max_records=admission.fetch_room())
            except BusError as exc:
                log.warning("worker %s: fetch failed (%s); retrying", self.config.worker_id, exc)
                await asyncio.sleep(0.5)
                continue
            for rec in records:
                decode.put(rec)
            admission.admit()
            if time.monotonic() - last_commit >= self.config.commit_interval_s:
                last_commit = time.monotonic()
                await ledger.commit()

    # -- cancel, status ---------------------------------------------------------------------------

    def cancel(self, request_id: str) -> int:
        """Abort ``request_id`` wherever it is here; remember it for a while (it may arrive later)."""
        return self.stages.aborts.cancel(request_id)

    def queue_depth(self) -> tuple[int, ...]:
        return self.stages.pipeline.admission.queue_depth()

    def status(self) -> WorkerStatus:
        owned = self._consumer.assignment() if self._consumer else set()
        status = self.stages.pipeline.admission.status(
            self.config.worker_id, self.config.model, self.state == "draining", self._lag, len(owned))
        takeover = self.stages.takeover
        if takeover is None:
            return status
        holds = self.stages.ledger.holds(owned, time.time(), HOLD_SLACK_S)
        return replace(status, holds=tuple(PartitionHold(tp.topic, tp.partition, ms) for tp, ms in sorted(holds.items())),
                       taken=self.stages.ledger.taken(), numerics=takeover.config.numerics)

    async def _refresh_lag(self) -> None:
        """Before each heartbeat: the records per tier still on the topic in our partitions."""
        if self._consumer is None:
            return
        try:
            by_tp = await self._consumer.lag()
        except BusError as exc:  # keep the last figures; the next heartbeat asks again
            log.debug("worker %s: consumer lag unavailable (%s)", self.config.worker_id, exc)
            return
        topics = self._topics
        lag = [0] * len(topics)
        for tp, n in by_tp.items():
            if tp.topic in topics:
                lag[topics.index(tp.topic)] += n
        self._lag = tuple(lag)
