"""The pipeline's last stage: the intake queue, and admission from it into the engine, by
effective priority, only while the engine has a free sequence slot and free KV blocks for the
prompt (the head of the queue waits for room; no lower-priority request jumps it); and the
intake's flow control, which pauses a tier's partitions while the intake holds
``prefetch_per_tier + free slots`` of that tier.

A request is handed to :class:`AsyncEngine` with its decoded sampling parameters (one type from
the record to the sampler, :mod:`lockgate_types`) and,
when another worker had started it, the tokens it already published (``resume_token_ids``). The
engine refusing it (``ValueError``) answers ``invalid_request``; a refused resume runs the request
from the start instead. Concurrency: event loop only; the engine's step loop (on the torch
thread) reaches it through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Sequence

from bus import Consumer, ErrorCode, WorkerStatus
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.intake.fair import request_cost
from engine_workers.worker.intake.queue import NUM_TIERS, IntakePolicy, IntakeQueue, RateMeter, estimate_wait
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Serving
from engine_workers.worker.replies.answers import Answers

log = logging.getLogger(__name__)


class EngineAdmission:
    """``serving``: on while the worker takes work (started, not draining). Fed by :meth:`put`
    (the intake checks), emptied by :meth:`admit` (after each fetch, each engine step, and at once
    for a request that waited)."""

    def __init__(self, worker_id: str, aengine: AsyncEngine, ledger: RequestLedger, intake: IntakeQueue[Job],
                 policy: IntakePolicy, answers: Answers, prefetch_per_tier: int, serving: Serving) -> None:
        self.worker_id = worker_id
        self.aengine = aengine
        self.ledger = ledger
        self.intake = intake
        self.policy = policy
        self.answers = answers
        self.prefetch_per_tier = prefetch_per_tier
        self.serving = serving
        self.rate = RateMeter()  # admissions per second: the heartbeat's wait estimate

    def room(self) -> int:
        """Free engine sequence slots (0 when the KV blocks are all spoken for)."""
        snap, ledger = self.aengine.snapshot, self.ledger
        if ledger.in_engine and snap.kv_blocks_free - ledger.reserved_blocks <= 0:
            return 0
        return max(0, self.aengine.engine.config.max_num_seqs - ledger.in_engine)

    def fetch_room(self) -> int:
        limit = self.prefetch_per_tier + self.room()
        return max(1, sum(max(0, limit - d) for d in self.ledger.held_by_tier()))

    def flow_control(self, c: Consumer, topics: Sequence[str]) -> None:
        """Pause the partitions of each tier whose intake is full (all of them when not serving),
        resume the others. Requests held before the intake (their reply topic's check, their
        resume lookup) count as in it: else a burst arriving while they wait is fetched whole."""
        assigned, paused = c.assignment(), c.paused()
        limit = self.prefetch_per_tier + self.room()
        depth = self.ledger.held_by_tier()
        for tier, topic in enumerate(topics):
            tps = {tp for tp in assigned if tp.topic == topic}
            if not self.serving.on or depth[tier] >= limit:
                if tps - paused:
                    c.pause(*(tps - paused))
            elif tps & paused:
                c.resume(*(tps & paused))

    def admit(self) -> None:
        """Move requests from the intake into the engine while it has room. Sync, never blocks."""
        if not self.serving.on:
            return
        now = time.time()
        for gone in self.intake.expire(now):
            assert gone.deadline is not None  # expire() returns only requests with a deadline
            gone.item.pending = None
            self.answers.error(gone.item, ErrorCode.EXPIRED, f"deadline passed {now - gone.deadline:.3f}s before admission")
        ledger = self.ledger
        while (p := self.intake.peek()) is not None:
            job = p.item
            if ledger.in_engine and (self.room() == 0 or
                                     job.blocks + ledger.reserved_blocks > self.aengine.snapshot.kv_blocks_free):
                if not self.preempts(job):
                    break
            self.intake.pop()
            job.pending = None
            if not self.submit(job):
                break

    def put(self, arrival: Arrival) -> None:
        """Queue a request that passed the intake checks; admit at once when it ``waited`` (no
        fetch's end will admit it)."""
        self.enqueue(arrival.job)
        if arrival.waited:
            self.admit()

    def drop_queued(self) -> None:
        """Drain: empty the intake; those requests stay in flight in the offset tracker (never
        committed here: the next owner runs them)."""
        for p in self.intake.remove_if(lambda _p: True):
            p.item.pending = None
            self.ledger.forget(p.item)

    def enqueue(self, job: Job) -> None:
        """Queue ``job`` in the intake; under fair share charged to its tenant at its weight, for
        its prompt plus its output budget (``fair.request_cost``)."""
        r = job.req
        job.pending = self.intake.push(r.request_id, r.tier, job.order_time, r.deadline, job, tenant=r.tenant,
                                       cost=request_cost(len(r.prompt_token_ids), r.sampling.max_tokens),
                                       weight=r.weight)

    def submit(self, job: Job) -> bool:
        """Hand ``job`` to the engine; False when the engine's command queue is full: the job is
        back in the intake (admitted again by a later ``admit``), never left marked admitted."""
        r = job.req
        arrival_mono = job.arrival - (time.time() - time.monotonic())
        try:
            fut = self.aengine.submit(job.eid, list(r.prompt_token_ids), r.sampling,
                                      cache_salt=r.cache_salt, priority=self.policy.engine_priority(r.tier, job.order_time),
                                      arrival_time=arrival_mono, resume_token_ids=list(job.resume), lora=r.lora,
                                      lora_path=r.lora_path)
        except queue.Full:
            log.warning("worker %s: engine command queue full; %s waits in the intake", self.worker_id, job.eid)
            self.enqueue(job)
            return False
        self.ledger.admitted(job)
        self.rate.record(time.time())
        loop = asyncio.get_running_loop()

        def done(f) -> None:  # engine thread
            if f.exception() is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.on_rejected, job, f.exception())

        fut.add_done_callback(done)
        return True

    def on_rejected(self, job: Job, exc: BaseException) -> None:
        self.ledger.left_engine(job)
        if job.resume and isinstance(exc, ValueError):
            # The published prefix cannot be continued (it ends in EOS or a stop string, or fills
            # the context): run the request from the start; the edge drops what it already has.
            log.info("worker %s: resuming %s failed (%s); running it from the start", self.worker_id,
                     job.eid, exc)
            job.resume = ()
            self.submit(job)
            return
        code = ErrorCode.INVALID_REQUEST if isinstance(exc, ValueError) else ErrorCode.INTERNAL
        self.answers.error(job, code, str(exc))
        self.admit()

    def preempts(self, job: Job) -> bool:
        """Whether ``job`` goes to the engine although it is full: it is more urgent than the worst
        running request by the engine's preemption margin (the engine then preempts that one by
        recompute; its stream stays exact), and no other such request is on its way in."""
        engine = self.aengine.engine
        margin = engine.config.priority_preemption_margin
        if margin is None or self.ledger.in_engine > engine.config.max_num_seqs:
            return False
        mine = self.policy.engine_priority(job.req.tier, job.order_time)
        running = [self.policy.engine_priority(j.req.tier, j.order_time) for j in self.ledger.admitted_jobs()]
        return bool(running) and mine + margin <= max(running)

    # -- what waits, and for how long -------------------------------------------------------------

    def queue_depth(self) -> tuple[int, ...]:
        """Waiting requests per tier: in the intake plus admitted but not yet running."""
        return self.ledger.queue_depth(self.intake.depth())

    def status(self, worker_id: str, model: str, draining: bool, lag: tuple[int, ...] = (0, 0, 0),
               partitions: int = 0) -> WorkerStatus:
        """The heartbeat: queue depth and estimated wait per tier, engine load, KV.

        A tier-``t`` request waits for what is ahead of it here (the intake, admitted requests not
        yet running) and for the records of tiers ``<= t`` still on the topic (``lag``): without
        the lag a backlog on Kafka was invisible to the edge until requests timed out."""
        snap, now = self.aengine.snapshot, time.time()
        engine_waiting = self.ledger.engine_waiting()
        rate, room = self.rate.rate(now), self.room()

        def wait(t: int) -> float:
            backlog = sum(lag[: t + 1])
            ahead = (self.intake.ahead_of(t, now) + engine_waiting if room == 0 else 0) + max(0, backlog - room)
            return estimate_wait(ahead, rate)

        return WorkerStatus(worker_id, model, now, self.queue_depth(), tuple(wait(t) for t in range(NUM_TIERS)),
                            snap.running, self.aengine.engine.config.max_num_seqs, snap.kv_usage,
                            snap.kv_blocks_total, snap.kv_blocks_free, snap.tokens_per_s, draining, lag, partitions,
                            self.aengine.engine.lora.names if self.aengine.engine.lora is not None else ())
