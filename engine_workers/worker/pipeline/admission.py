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
from engine_workers.engine.step_model import StepModel
from engine_workers.worker.config import DEFAULT_SLO_TPOT_MS
from engine_workers.worker.intake.fair import request_cost
from engine_workers.worker.intake.predict import Backlog, predict_wait
from engine_workers.worker.intake.queue import NUM_TIERS, IntakePolicy, IntakeQueue, RateMeter
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Serving
from engine_workers.worker.replies.answers import Answers

log = logging.getLogger(__name__)


class EngineAdmission:
    """``serving``: on while the worker takes work (started, not draining). Fed by :meth:`put`
    (the intake checks), emptied by :meth:`admit` (after each fetch, each engine step, and at once
    for a request that waited)."""

    def __init__(self, worker_id: str, aengine: AsyncEngine, ledger: RequestLedger, intake: IntakeQueue[Job],
                 policy: IntakePolicy, answers: Answers, prefetch_per_tier: int, serving: Serving,
                 slo_tpot_ms: tuple[float, ...] = DEFAULT_SLO_TPOT_MS) -> None:
        self.worker_id = worker_id
        self.aengine = aengine
        self.ledger = ledger
        self.intake = intake
        self.policy = policy
        self.answers = answers
        self.prefetch_per_tier = prefetch_per_tier
        self.serving = serving
        self.rate = RateMeter()  # admissions per second: the slot turnover of the wait prediction
        self.slo_tpot_ms = slo_tpot_ms  # per tier: each request's TPOT target in the engine
        self.steps = StepModel()  # the engine's step time against its batched tokens, from the snapshots
        self._step_seen = -1
        self.mean_prompt = 0.0  # mean prompt tokens of the requests queued (records on the topic count as this)

    def free_blocks(self) -> int:
        """KV blocks a new request can count on: the engine's free blocks, less what its sequences
        still take to finish their prefills (chunked: counted by the engine chunk by chunk), less
        the blocks of admissions the engine had not applied when its snapshot was taken."""
        snap = self.aengine.snapshot
        return snap.kv_blocks_free - snap.kv_blocks_to_prefill - self.ledger.reserved_blocks(snap.adds_applied)

    def room(self) -> int:
        """Free engine sequence slots (0 when the KV blocks are all spoken for)."""
        ledger = self.ledger
        if ledger.in_engine and self.free_blocks() <= 0:
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
            if ledger.in_engine and (self.room() == 0 or job.blocks > self.free_blocks()):
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
        self.mean_prompt += (len(r.prompt_token_ids) - self.mean_prompt) * 0.05
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
                                      lora_path=r.lora_path, tpot_slo_s=self.slo_tpot_ms[r.tier] / 1000.0,
                                      tier=r.tier)
        except queue.Full:
            log.warning("worker %s: engine command queue full; %s waits in the intake", self.worker_id, job.eid)
            self.enqueue(job)
            return False
        self.ledger.admitted(job)
        self.rate.record(time.time())
        loop = asyncio.get_running_loop()

        def done(f) -> None:  # engine thread
            if loop.is_closed() or f.cancelled():
                return
            if f.exception() is not None:
                loop.call_soon_threadsafe(self.on_rejected, job, f.exception())
            else:
                loop.call_soon_threadsafe(self.on_added, job, f.result())

        fut.add_done_callback(done)
        return True

    def on_added(self, job: Job, number: int) -> None:
        """The engine applied ``job``'s add as its ``number``-th: from the first snapshot that
        counts it (``adds_applied >= number``), its blocks are the engine's to count."""
        if job.admitted:
            job.engine_add = number

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
        admitted = self.ledger.admitted_jobs()
        # one at a time: a request as urgent that went in and has not started yet is taking (or
        # waiting for) the room a preemption makes; this one waits in the intake behind it (when
        # the KV cache, not the slots, is the limit, in_engine alone would let every one through)
        if any(not j.started and j.req.tier <= job.req.tier for j in admitted):
            return False
        # as the engine decides (scheduler.py): a whole tier more urgent, and more urgent by the
        # aged priority too
        mine = self.policy.engine_priority(job.req.tier, job.order_time)
        return any(job.req.tier + margin <= j.req.tier and mine < self.policy.engine_priority(j.req.tier, j.order_time)
                   for j in admitted)

    # -- what waits, and for how long -------------------------------------------------------------

    def queue_depth(self) -> tuple[int, ...]:
        """Waiting requests per tier: in the intake plus admitted but not yet running."""
        return self.ledger.queue_depth(self.intake.depth())

    def observe_step(self) -> None:
        """Feed the engine's last step (its time and batched tokens, from the snapshot) to the
        step-time line of the wait prediction; a snapshot already seen is skipped."""
        snap = self.aengine.snapshot
        if snap.steps != self._step_seen and snap.step_time_s > 0:
            self._step_seen = snap.steps
            self.steps.observe(snap.last_batch_tokens, snap.step_time_s)

    def predicted_wait(self, tier: int, now: float, lag: tuple[int, ...] = (0, 0, 0)) -> float:
        """Seconds a request of ``tier`` arriving ``now`` waits for its first chunk to run here
        (``intake/predict.py``): the prompt tokens ahead of it (the engine's unfinished prefills,
        admissions the engine has not applied, the queued requests that sort before it, and the
        records of its tier and the tiers above still on the topic, ``lag``, at the mean prompt
        size), over the step's token budget at the measured step time; or the slot turnover,
        when no sequence slot is free, if that is longer."""
        snap, ledger = self.aengine.snapshot, self.ledger
        config = self.aengine.engine.config
        queued = self.intake.queued_ahead(tier, now)
        unapplied = [j for j in ledger.admitted_jobs() if j.engine_add == 0 or j.engine_add > snap.adds_applied]
        on_topic = sum(lag[: tier + 1])
        tokens = (snap.kv_blocks_to_prefill * config.block_size
                  + sum(len(j.req.prompt_token_ids) for j in unapplied)
                  + sum(len(p.item.req.prompt_token_ids) for p in queued)
                  + int(on_topic * self.mean_prompt))
        line = self.steps.line()
        budget = config.max_num_batched_tokens
        running = [j for j in ledger.admitted_jobs() if j.started]
        if line is not None and running and config.tpot_budget:
            strictest = min(self.slo_tpot_ms[j.req.tier] for j in running) / 1000.0
            # as the engine sizes its steps (Engine._token_budget)
            step_s = max(strictest, 2 * line.seconds(snap.running))
            budget = max(1, min(budget, line.tokens_within(step_s)))
        free = max(0, config.max_num_seqs - ledger.in_engine)
        backlog = Backlog(tokens, len(queued) + ledger.engine_waiting() + on_topic, snap.running, free)
        return predict_wait(backlog, line, budget, self.rate.rate(now))

    def status(self, worker_id: str, model: str, draining: bool, lag: tuple[int, ...] = (0, 0, 0),
               partitions: int = 0) -> WorkerStatus:
        """The heartbeat: queue depth and predicted wait per tier (:meth:`predicted_wait`; the
        records still on the topic, ``lag``, count: without them a backlog on Kafka was invisible
        to the edge until requests timed out), engine load, KV."""
        snap, now = self.aengine.snapshot, time.time()
        waits = tuple(self.predicted_wait(t, now, lag) for t in range(NUM_TIERS))
        return WorkerStatus(worker_id, model, now, self.queue_depth(), waits,
                            snap.running, self.aengine.engine.config.max_num_seqs, snap.kv_usage,
                            snap.kv_blocks_total, snap.kv_blocks_free, snap.tokens_per_s, draining, lag, partitions,
                            self.aengine.engine.lora.names if self.aengine.engine.lora is not None else ())
