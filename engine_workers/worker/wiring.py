"""The worker's stages built from one config: which stage hands work to which, in one place.

:func:`wire` is the factory :class:`~engine_workers.worker.actor.Worker` calls; the actor keeps
only its lifecycle and the tasks it owns. Every stage is built after the stages it hands work to,
and handed them then, so the object graph has no cycle and nothing is bound late:

* the **pipeline** (``pipeline/``), a request's one way in: ``decode`` -> ``gate`` -> ``resume``
  -> ``checks`` -> ``admission`` (the intake queue, then the engine). ``failures`` re-runs a
  request whose replies failed, into ``checks``.
* the **way back** (``replies/``): the engine's step outputs (``outputs``) become chunks on the
  ``sender`` and finals (``answers``, per-tenant ``usage``). The sender reports a failed send to
  :class:`FailedSends`, built before it from the ledger and the engine alone, which posts it for
  ``failures``: the sender and the pipeline never hold each other.
* the **ledger** (``offsets/``) is passive state every stage reads and writes; ``aborts``, the
  control topic's cancels and the consumer's rebalance listener, drives it (it asks the ledger
  which partitions were lost; the ledger calls nothing back).

Invariant: built once per worker, before ``start``; the objects are the worker's for its life.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bus import Bus
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.outputs import RequestOutput
from engine_workers.worker.aborts import Aborts
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.failover.detector import PeerDetector
from engine_workers.worker.failover.takeover import Takeover, TakeoverConfig, claimed
from engine_workers.worker.health.metrics import WorkerMetrics
from engine_workers.worker.health.usage import UsageLog
from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue, parse_intake_mode
from engine_workers.worker.offsets.dead_letters import DeadLetters
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.admission import EngineAdmission
from engine_workers.worker.pipeline.checks import IntakeChecks
from engine_workers.worker.pipeline.decode import RecordDecoder
from engine_workers.worker.pipeline.failures import FailedSends, SendFailures
from engine_workers.worker.pipeline.gate import ReplyGate
from engine_workers.worker.pipeline.handoff import Serving
from engine_workers.worker.pipeline.resume import ResumeFinder
from engine_workers.worker.replies.answers import Answers
from engine_workers.worker.replies.outputs import StepOutputs
from engine_workers.worker.replies.sender import ReplySender
from engine_workers.worker.spans import WorkerSpans
from tracing import Tracer


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A request's way in, in order (``pipeline/__init__.py``), and the dead letters its stages
    send."""

    decode: RecordDecoder
    gate: ReplyGate
    resume: ResumeFinder
    checks: IntakeChecks
    admission: EngineAdmission
    failures: SendFailures
    dead_letters: DeadLetters

    async def stop(self, grace_s: float) -> None:
        """Let go of what the stages hold (those requests stay uncommitted for the next owner);
        wait up to ``grace_s`` for the dead letters in flight (an acknowledged one finishes its
        offset, which the worker's final commit then includes)."""
        await self.resume.stop()
        self.failures.stop()
        await self.gate.stop()
        await self.dead_letters.stop(grace_s)


@dataclass(frozen=True, slots=True)
class WayBack:
    """The engine's outputs to the reply topics."""

    outputs: StepOutputs
    sender: ReplySender
    answers: Answers
    usage: UsageLog

    async def stop(self, grace_s: float) -> None:
        await self.sender.stop()
        await self.usage.stop(grace_s)


@dataclass(frozen=True, slots=True)
class Stages:
    serving: Serving  # the actor's one switch the stages read
    pipeline: Pipeline
    way_back: WayBack
    ledger: RequestLedger
    aborts: Aborts
    metrics: WorkerMetrics
    takeover: Takeover | None  # None: failover off

    def engine_stepped(self, outputs: list[RequestOutput]) -> None:
        """The engine's ``on_outputs``, once per step on the event loop: publish (non-blocking),
        refresh the gauges, then admit into the room the step freed."""
        self.way_back.outputs.publish(outputs)
        self.pipeline.admission.observe_step()
        self.observe()
        self.pipeline.admission.admit()

    def observe(self) -> None:
        """Refresh the gauges (queue depth and running per tier, KV usage) from current state."""
        admission = self.pipeline.admission
        self.metrics.observe_snapshot(admission.aengine.snapshot, admission.queue_depth(),
                                      self.ledger.running_by_tier())


def wire(config: WorkerConfig, bus: Bus, aengine: AsyncEngine, tracer: Tracer | None = None) -> Stages:
    """Build every stage of one worker from its config (see the module docstring for who feeds whom);
    ``tracer``: spans per request (``spans``), None when tracing is off. Installs the engine's
    ``on_step`` (the step metrics); the actor installs ``on_outputs`` (:meth:`Stages.engine_stepped`)."""
    wid = config.worker_id
    metrics = WorkerMetrics(config.model)
    aengine.on_step = metrics.observe_step
    policy = IntakePolicy(parse_intake_mode(config.intake_mode), config.aging_period_s, reference_time=time.time())
    intake: IntakeQueue[Job] = IntakeQueue(policy, fair_share=config.fair_share)
    serving = Serving()
    ledger = RequestLedger(wid, config.revoke_flush_s)
    dead_letters = DeadLetters(bus, config.layout, wid, ledger.offsets, metrics.dead_letters.inc)
    # the way back
    failed = FailedSends(ledger, aengine)
    sender = ReplySender(bus, wid, config.send_retries, on_failed=failed.report,
                         max_record_bytes=config.max_reply_record_bytes)
    usage = UsageLog(bus, config.layout.usage_topic, metrics.registry, config.model, wid)
    spans = WorkerSpans(tracer, wid) if tracer is not None else None  # docs/observability.md, "Tracing"
    answers = Answers(sender, ledger, metrics, wid, usage, spans)
    outputs = StepOutputs(aengine, ledger, sender, answers, metrics)
    aborts = Aborts(aengine, ledger, intake, answers, sender)
    # the pipeline, from its end
    admission = EngineAdmission(wid, aengine, ledger, intake, policy, answers, config.prefetch_per_tier, serving,
                                config.slo_tpot_ms)
    checks = IntakeChecks(config.model, serving, aborts, answers, admission)
    detector = PeerDetector(wid, config.model, config.detect_s)
    resume = ResumeFinder(bus, wid, answers.answered_before, lambda tp: ledger.assigned_at.get(tp),
                          sender.partition_count, metrics.resumed, checks,
                          claimed=lambda job: claimed(detector, ledger, job))
    gate = ReplyGate(wid, sender, ledger, dead_letters, resume)
    decode = RecordDecoder(ledger, serving, dead_letters, aengine.engine.config.block_size, policy.aging_period_s,
                           config.age_credit_periods, spans, gate,
                           tiers={t: i for i, t in enumerate(config.layout.request_topics(config.model))})
    failures = SendFailures(wid, failed, ledger, dead_letters, answers, checks, reruns=config.send_failure_reruns)
    # failover: a dead peer's requests enter at the reply gate (a fenced run of ours waits in resume)
    takeover = Takeover(bus, TakeoverConfig(wid, config.model, config.layout.status_topic, config.detect_s,
                                            numerics_fingerprint(aengine), aengine.engine.config.block_size,
                                            tuple(config.layout.request_topics(config.model))),
                        detector, ledger, serving, gate, resume, aborts.stop_run,
                        lambda: ledger.consumer.assignment() if ledger.consumer is not None else set()) \
        if config.failover else None
    return Stages(serving, Pipeline(decode, gate, resume, checks, admission, failures, dead_letters),
                  WayBack(outputs, sender, answers, usage), ledger, aborts, metrics, takeover)


def numerics_fingerprint(aengine: AsyncEngine) -> str:
    """What decides this worker's logits, bit for bit: device, precision, quantization, KV storage,
    kernels and their ISA level, tensor-parallel size (docs/worker.md, "Failover": exact takeovers
    need equal ones)."""
    e = aengine.engine
    c = e.config
    device = getattr(getattr(e, "device", None), "type", c.device)
    parts = [device, str(getattr(e, "dtype", c.dtype)), c.quantization, f"kv={getattr(e, 'kv_dtype', c.kv_cache_dtype)}",
             f"kernels={int(c.cpu_kernels)}", f"tp={c.tensor_parallel_size}"]
    if device == "cpu" and c.cpu_kernels:
        from engine_workers.kernels.cpu_kernels import isa_level  # CPU only: decided once
        parts.append(isa_level())
    return "/".join(parts)
