"""The worker actor: one per engine. Bus records in, engine work, reply streams out.

A thin asyncio shell; each stage is a module of its own, built and connected by ``wiring.wire``
from the one :class:`WorkerConfig` (``docs/worker.md`` walks through them):

* **intake** — a consumer in group ``<ns>.workers.<model>`` reads the model's three priority topics.
  Records are decoded (undecodable -> dead letter, ``dead_letters``), wait for their reply topic's
  check (``reply_gate``) and, when another worker may have started them, for the tokens already
  published (``resume``), are checked (wrong model -> ``invalid_request``, past deadline ->
  ``expired``, cancelled earlier -> ``abort``) and queued in the :class:`IntakeQueue` (``intake``).
* **admission** — into the engine by effective priority while it has room, and the intake's flow
  control (``admission``).
* **replies** — per-step outputs (``outputs``) become ``TokenChunk`` records, one per reply
  partition per step (``reply_sender``, split under the record size limit), and a final
  ``Finished``/``Error`` (``answers``); a failed send re-runs the request (``send_failures``).
* **offsets** — a record's offset is finished when its final reply is acknowledged; each partition
  commits its low watermark; rebalance aborts the requests of partitions that moved (``ledger``,
  ``aborts``).
* **control** — ``Cancel`` aborts the request wherever it is, freeing KV within one engine step
  (``aborts``);
  **heartbeat** — ``WorkerStatus`` every ``heartbeat_s`` (``loops``); metrics and
  ``/healthz``/``/readyz``/``/metrics`` (``metrics``, ``health``).

Lifecycle: ``start``/``stop`` idempotent, ``async with``; ``drain()`` stops intake, lets what the
engine holds finish (up to ``drain_grace_s``), commits it and stops; requests still queued stay
uncommitted for the other workers. Every background task is owned and cancelled by ``stop``.
Concurrency: all state lives on the event loop; the engine thread only reaches it through
``call_soon_threadsafe`` (AsyncEngine's ``on_outputs`` and the admission futures).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from bus import (
    Bus,
    BusError,
    Consumer,
    DecodeError,
    ErrorCode,
    FinishReason,
    InferenceRequest,
    WorkerStatus,
    decode,
    safe_name,
)
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.core import Engine, RequestOutput
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.health.metrics import CONTENT_TYPE
from engine_workers.worker.health.server import HealthServer
from engine_workers.worker.intake.queue import (
    aging_start,
)
from engine_workers.worker.loops import heartbeat, read_cancels
from engine_workers.worker.offsets.ledger import Job
from engine_workers.worker.wiring import Hooks, wire

log = logging.getLogger(__name__)

POLL_MS = 50
STOP_COMMIT_S = 5.0


class Worker:
    """See the module docstring. ``engine``: an :class:`Engine` (the worker wraps and owns an
    :class:`AsyncEngine`) or an :class:`AsyncEngine` (started if needed, never stopped here).

    ``before_step``: called on the engine's torch thread right before each engine step (the
    :class:`AsyncEngine` hook of that name; installed on a given AsyncEngine until :meth:`stop`).
    For tests that need the step loop paced or slowed (``lambda: time.sleep(0.02)``) without
    replacing ``engine.step``; None (the default) in production."""

    def __init__(self, config: WorkerConfig, bus: Bus, engine: Engine | AsyncEngine, *,
                 before_step: Callable[[], None] | None = None) -> None:
        self.config = config
        self.bus = bus
        if isinstance(engine, AsyncEngine):
            self.aengine, self._owns_engine = engine, False
            engine.on_outputs = self._on_outputs
            if before_step is not None:
                engine.before_step = before_step
        else:
            self.aengine, self._owns_engine = AsyncEngine(engine, on_outputs=self._on_outputs,
                                                          before_step=before_step), True
        self._before_step = before_step
        self.engine = self.aengine.engine
        st = wire(config, bus, self.aengine, Hooks(accept=self._accept, send_failed=self._on_send_failed,
                                                   rerun=self._rerun, serving=lambda: self.state == "started"))
        self.metrics, self.policy, self.intake, self.ledger = st.metrics, st.policy, st.intake, st.ledger
        self.offsets, self.replies, self.usage, self.answers = st.offsets, st.replies, st.usage, st.answers
        self.outputs, self.aborts, self.admission = st.outputs, st.aborts, st.admission
        self._resume, self._gate, self._send_failures = st.resume, st.gate, st.send_failures
        self._topics = config.layout.request_topics(config.model)
        self._eids = itertools.count()
        self._consumer: Consumer | None = None
        self._control: Consumer | None = None
        self._tasks: list[asyncio.Task] = []
        self._lag: tuple[int, ...] = (0, 0, 0)
        self._health: HealthServer | None = None
        self._drain_requested = asyncio.Event()
        self.state = "new"  # new -> started -> draining -> stopped

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.state != "new":
            return
        self.state = "starting"
        try:
            await self.aengine.start()
            await self.bus.ensure_topics(self.config.layout.model_specs(self.config.model))
            self._control = self.bus.consumer([self.config.layout.control_topic], start_from="latest")
            await self._control.start()
            self._consumer = self.bus.consumer(self._topics, group_id=self.config.group, start_from="earliest",
                                               on_assigned=self.ledger.on_assigned, on_revoked=self.ledger.on_revoked)
            self.ledger.consumer = self._consumer
            await self._consumer.start()
            if self.config.metrics_port is not None:
                self._health = HealthServer(self.config.metrics_host, self.config.metrics_port, live=self.live,
                                            ready=self.ready, metrics=self.render_metrics, metrics_content_type=CONTENT_TYPE)
                await self._health.start()
        except BaseException:
            await self.stop()
            raise
        self.state = "started"
        cfg = self.config
        for name, coro in (("intake", self._intake_loop()),
                           ("control", read_cancels(self._control, self.cancel, cfg.worker_id)),
                           ("heartbeat", heartbeat(self.bus, cfg.layout.status_topic, cfg.worker_id, self.status,
                                                   cfg.heartbeat_s, before=self._observe, refresh=self._refresh_lag)),
                           # a crashed step loop (say a tensor-parallel rank died) ends run(): the
                           # worker stops uncommitted and exits non-zero, its requests resume elsewhere
                           ("engine", self.aengine.crashed())):
            self._tasks.append(asyncio.create_task(coro, name=f"{self.config.worker_id}-{name}"))
        log.info("worker %s serving %s (group %s, intake %s, aging period %gs)", self.config.worker_id,
                 self.config.model, self.config.group, self.policy.mode.value, self.policy.aging_period_s)

    async def stop(self) -> None:
        """Stop now: commit what is finished, leave the group without committing unfinished work.
        Idempotent. The commit is bounded by ``STOP_COMMIT_S``: a broken bus must not hold the stop."""
        if self.state == "stopped":
            return
        was, self.state = self.state, "stopped"
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._resume.stop()  # held lookups: their requests stay uncommitted
        self._send_failures.stop()  # failed requests waiting to run again: uncommitted too
        await self._gate.stop(STOP_COMMIT_S)  # a dead letter acknowledged finishes its offset: before the commit
        if was in ("started", "draining"):
            # Work finished since the intake loop's last periodic commit: without this a clean
            # stop would leave up to commit_interval_s of it to be re-run by the next owner.
            try:
                await asyncio.wait_for(self.ledger.commit(), STOP_COMMIT_S)
            except TimeoutError:
                log.warning("worker %s: final commit timed out after %gs; the next owner re-runs that work",
                            self.config.worker_id, STOP_COMMIT_S)
        await self.replies.stop()
        await self.usage.stop(STOP_COMMIT_S)
        for c in (self._consumer, self._control):
            if c is not None:
                await c.stop()
        if self._health is not None:
            await self._health.stop()
        if self._owns_engine:
            await self.aengine.stop()
        elif self.aengine.on_outputs == self._on_outputs:
            self.aengine.on_outputs = None
            self.aengine.on_step = None
            if self._before_step is not None and self.aengine.before_step is self._before_step:
                self.aengine.before_step = None

    async def drain(self, grace_s: float | None = None) -> bool:
        """SIGTERM path: stop taking work, finish what the engine holds (up to ``grace_s``, default
        the config's), commit it, then :meth:`stop`. Queued requests are left uncommitted for the
        other workers. Returns True when everything admitted finished in time."""
        if self.state != "started":
            await self.stop()
            return True
        self.state = "draining"
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        for p in self.intake.remove_if(lambda _p: True):
            self.ledger.forget(p.item)  # stays in flight in the offset tracker: never committed here
        deadline = time.monotonic() + grace
        while self.ledger.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        done = not self.ledger.busy()
        await self.ledger.commit()
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
        self._observe()
        return self.metrics.render()

    # -- intake -----------------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        assert self._consumer is not None
        last_commit = time.monotonic()
        while True:
            self.admission.flow_control(self._consumer, self._topics)
            try:
                records = await self._consumer.getmany(timeout_ms=POLL_MS, max_records=self.admission.fetch_room())
            except BusError as exc:
                log.warning("worker %s: fetch failed (%s); retrying", self.config.worker_id, exc)
                await asyncio.sleep(0.5)
                continue
            for rec in records:
                await self._on_record(rec)
            self.admission.admit()
            if time.monotonic() - last_commit >= self.config.commit_interval_s:
                last_commit = time.monotonic()
                await self.ledger.commit()

    async def _on_record(self, rec) -> None:
        tp = rec.tp
        if not self.ledger.fetched(tp, rec.offset):
            return  # re-delivered after a rebalance that left us the partition: we have it
        if self.state != "started":
            return  # draining: stays uncommitted
        try:
            msg = decode(rec.value)
        except DecodeError as exc:
            msg, why = None, str(exc)
        else:
            why = f"expected a request, got {type(msg).__name__}"
        if not isinstance(msg, InferenceRequest):
            # In the background, retried until acknowledged, then its offset finished: a
            # dead-letter topic that cannot be written never stops the intake (dead_letters.py).
            self._gate.dead_letters.send(rec, why)
            return
        now = time.time()
        arrival = msg.enqueued_at if 0 < msg.enqueued_at <= now else now
        bs = self.engine.config.block_size
        job = Job(f"{msg.request_id}#{next(self._eids)}", msg, tp, rec.offset, arrival,
                  -(-(len(msg.prompt_token_ids) + 1) // bs),
                  aging_from=aging_start(arrival, now, self.policy.aging_period_s, self.config.age_credit_periods))
        self.ledger.add(job)
        self._gate.submit(job)  # -> _accept once its reply topic is known to exist

    def _accept(self, job: Job, held: bool) -> None:
        """A request whose reply topic exists: answered at once (wrong model, cancelled earlier,
        past its deadline) or queued in the intake. Called from ``_on_record`` (the intake loop
        admits after the whole fetch, so a fetch's requests are chosen among by priority) or,
        ``held``, by the gate after the first check of its reply topic (admitted from here)."""
        if self.state != "started":
            return  # draining or stopped: stays uncommitted for the next owner
        msg, now = job.req, time.time()
        if safe_name(msg.model) != safe_name(self.config.model):
            self.answers.error(job, ErrorCode.INVALID_REQUEST, f"model {msg.model!r} is not served here ({self.config.model!r})")
        elif self.aborts.cancelled(msg.request_id):
            self.answers.unrun(job, FinishReason.ABORT)
        elif msg.deadline is not None and msg.deadline <= now:
            self.answers.error(job, ErrorCode.EXPIRED, f"deadline passed {now - msg.deadline:.3f}s before intake")
        else:
            self.admission.enqueue(job)
            if held:
                self.admission.admit()

    # -- outputs ----------------------------------------------------------------------------------

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """AsyncEngine callback, on the event loop: publish (non-blocking), then admit more."""
        self.outputs.publish(outputs)
        self._observe()
        self.admission.admit()

    def _on_send_failed(self, eid: str, undeliverable: str | None) -> None:
        """ReplySender's ``on_failed``. The bus failed (``undeliverable`` None): the request runs
        again, then is answered with an error, then dead-lettered (:class:`SendFailures`), its
        offset in flight until one of them succeeds. Its reply topic does not exist: no other
        worker could answer it either, so it is dead-lettered and its offset finished once the
        dead letter is acknowledged. Either way it never pins its partition's commits."""
        job = self.ledger.get(eid)
        if job is None:
            return
        job.lost = True  # publish nothing more of this run
        if job.admitted:
            self.aengine.abort(job.eid)
        else:
            self.ledger.forget(job)
        if undeliverable is None:
            self._send_failures.failed(job)
        else:
            self._gate.dead_letter(job, undeliverable)

    def _rerun(self, job: Job) -> None:
        """A request whose replies failed, queued again from the start (the intake's checks apply)."""
        self._accept(job, True)

    # -- cancel, rebalance ------------------------------------------------------------------------

    def cancel(self, request_id: str) -> int:
        """Abort ``request_id`` wherever it is here; remember it for a while (it may arrive later)."""
        return self.aborts.cancel(request_id)

    # -- status -----------------------------------------------------------------------------------

    def queue_depth(self) -> tuple[int, ...]:
        return self.admission.queue_depth()

    def status(self) -> WorkerStatus:
        return self.admission.status(self.config.worker_id, self.config.model, self.state == "draining",
                                     self._lag, len(self._consumer.assignment()) if self._consumer else 0)

    async def _refresh_lag(self) -> None:
        """Before each heartbeat: the records per tier still on the topic in our partitions."""
        if self._consumer is None:
            return
        try:
            by_tp = await self._consumer.lag()
        except BusError as exc:  # keep the last figures; the next heartbeat asks again
            log.debug("worker %s: consumer lag unavailable (%s)", self.config.worker_id, exc)
            return
        lag = [0] * len(self._topics)
        for tp, n in by_tp.items():
            if tp.topic in self._topics:
                lag[self._topics.index(tp.topic)] += n
        self._lag = tuple(lag)

    def _observe(self) -> None:
        """Refresh the gauges (queue depth and running per tier, KV usage) from current state."""
        self.metrics.observe_snapshot(self.aengine.snapshot, self.admission.queue_depth(), self.ledger.running_by_tier())
