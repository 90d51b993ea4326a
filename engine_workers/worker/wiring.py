"""The worker's stages built from one config: which collaborator gets which other, in one place.

:func:`wire` is the factory :class:`~engine_workers.worker.actor.Worker` calls; the actor keeps
only its lifecycle and the loops. The stages reach back into the actor through :class:`Hooks`
(plain callables), so nothing here imports the actor and the graph stays one-way:

* ``intake`` (the priority queue under ``policy``) feeds ``admission``, which moves jobs into the
  engine; ``ledger`` holds every accepted job and its offsets (``offsets``), and tells ``aborts``
  which jobs a revoked partition lost.
* ``replies`` sends the token chunks; ``answers`` the finals (and ``usage`` per tenant);
  ``outputs`` turns an engine step's outputs into both.
* ``gate`` checks a request's reply topic before it runs, ``resume`` finds what another worker
  already published of it, ``send_failures`` re-runs or dead-letters a request whose send failed.

Invariant: built once per worker, before ``start``; the objects are the worker's for its life.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from bus import Bus, TopicPartition
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.aborts import Aborts
from engine_workers.worker.admission import EngineAdmission
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.health.metrics import WorkerMetrics
from engine_workers.worker.health.usage import UsageLog
from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue, parse_intake_mode
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.offsets.resume import ResumeFinder
from engine_workers.worker.offsets.watermark import OffsetTracker
from engine_workers.worker.replies.answers import Answers
from engine_workers.worker.replies.failures import SendFailures
from engine_workers.worker.replies.gate import ReplyGate
from engine_workers.worker.replies.outputs import StepOutputs
from engine_workers.worker.replies.sender import ReplySender


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the stages call back on the actor."""

    accept: Callable[[Job, bool], None]  # a job cleared by the gate / resume: queue it (held: resumed)
    send_failed: Callable[[str, str | None], None]  # an engine id whose reply could not be sent
    rerun: Callable[[Job], None]  # run a job again after a failed send
    serving: Callable[[], bool]  # whether the worker is started (admission stops otherwise)


@dataclass(frozen=True, slots=True)
class Stages:
    metrics: WorkerMetrics
    policy: IntakePolicy
    intake: IntakeQueue[Job]
    ledger: RequestLedger
    offsets: OffsetTracker[TopicPartition]
    replies: ReplySender
    usage: UsageLog
    answers: Answers
    outputs: StepOutputs
    aborts: Aborts
    admission: EngineAdmission
    resume: ResumeFinder
    gate: ReplyGate
    send_failures: SendFailures


def wire(config: WorkerConfig, bus: Bus, aengine: AsyncEngine, hooks: Hooks) -> Stages:
    """Build every stage of one worker from its config (see the module docstring for who feeds whom)."""
    metrics = WorkerMetrics(config.model)
    aengine.on_step = metrics.observe_step
    policy = IntakePolicy(parse_intake_mode(config.intake_mode), config.aging_period_s, reference_time=time.time())
    intake: IntakeQueue[Job] = IntakeQueue(policy, fair_share=config.fair_share)
    # ``aborts`` needs the ledger and the ledger reports lost jobs to ``aborts``: late-bound.
    aborts: list[Aborts] = []
    ledger = RequestLedger(config.worker_id, config.revoke_flush_s, on_lost=lambda lost: aborts[0].release(lost))
    replies = ReplySender(bus, config.worker_id, config.send_retries, on_failed=hooks.send_failed,
                          max_record_bytes=config.max_reply_record_bytes)
    usage = UsageLog(bus, config.layout.usage_topic, metrics.registry, config.model, config.worker_id)
    answers = Answers(replies, ledger, metrics, config.worker_id, usage)
    outputs = StepOutputs(aengine, ledger, replies, answers, metrics)
    aborts.append(Aborts(aengine, ledger, intake, answers, replies))
    admission = EngineAdmission(config.worker_id, aengine, ledger, intake, policy, answers,
                                config.prefetch_per_tier, hooks.serving)
    resume = ResumeFinder(bus, config.worker_id, hooks.accept, answers.answered_before,
                          lambda tp: ledger.assigned_at.get(tp), replies.partition_count, metrics.resumed)
    gate = ReplyGate(bus, config.layout, config.worker_id, replies, ledger, resume.submit, metrics.dead_letters.inc)
    send_failures = SendFailures(config.worker_id, ledger, gate.dead_letters, hooks.rerun, answers.error,
                                 reruns=config.send_failure_reruns)
    return Stages(metrics, policy, intake, ledger, ledger.offsets, replies, usage, answers, outputs, aborts[0],
                  admission, resume, gate, send_failures)
