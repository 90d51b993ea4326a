"""The pipeline's first stage: a fetched bus record becomes a held request (a
:class:`~engine_workers.worker.offsets.ledger.Job`), or a dead letter.

Per record, in order: held in the ledger until its offset is finished (a record already held,
re-delivered after a rebalance that left the partition here, is skipped); nothing more while the
worker does not serve (draining: the record stays uncommitted for the next owner); decoded (not an
``InferenceRequest``: dead-lettered in the background, its offset finished once the letter is
acknowledged, so a dead-letter topic that cannot be written never stops the intake); its job built
(engine id, KV blocks of its prompt, the instant its aging counts from), its worker span begun
when tracing is on, and handed on, not waited.

Concurrency: event loop only (the actor's intake loop calls :meth:`RecordDecoder.put`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import replace

from bus import DecodeError, InferenceRequest, Record, decode
from engine_workers.worker.intake.queue import aging_start
from engine_workers.worker.offsets.dead_letters import DeadLetters
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Serving, Stage
from engine_workers.worker.spans import WorkerSpans


class RecordDecoder:
    """``block_size``: the engine's KV block size (a job's ``blocks``); ``aging_period_s`` and
    ``age_credit_periods``: the intake's aging (:func:`aging_start`); ``spans``: None when tracing
    is off; ``next_stage``: the reply gate; ``tiers``: each request topic's tier (a record's tier is
    its topic's)."""

    def __init__(self, ledger: RequestLedger, serving: Serving, dead_letters: DeadLetters, block_size: int,
                 aging_period_s: float, age_credit_periods: float | None, spans: WorkerSpans | None,
                 next_stage: Stage, tiers: Mapping[str, int] | None = None) -> None:
        self.tiers: Mapping[str, int] = tiers or {}
        self.ledger = ledger
        self.serving = serving
        self.dead_letters = dead_letters
        self.block_size = block_size
        self.aging_period_s = aging_period_s
        self.age_credit_periods = age_credit_periods
        self.spans = spans
        self.next_stage = next_stage
        self._eids = itertools.count()  # engine ids stay unique when a request id comes back

    def put(self, rec: Record) -> None:
        if not self.ledger.fetched(rec.tp, rec.offset):
            return  # re-delivered after a rebalance that left us the partition: we have it
        if not self.serving.on:
            return  # draining: stays uncommitted
        try:
            msg = decode(rec.value)
        except DecodeError as exc:
            msg, why = None, str(exc)
        else:
            why = f"expected a request, got {type(msg).__name__}"
        if not isinstance(msg, InferenceRequest):
            self.dead_letters.send(rec, why)
            return
        # The tier is the topic's, never the record's own field: whoever may write to the p2
        # topic could otherwise label a record p0 and be served ahead of p0 traffic. (The edge
        # publishes a request on its tier's topic; a record whose field disagrees is relabelled.)
        tier = self.tiers.get(rec.tp.topic, msg.tier)
        if tier != msg.tier:
            msg = replace(msg, tier=tier)
        now = time.time()
        arrival = msg.enqueued_at if 0 < msg.enqueued_at <= now else now
        job = Job(f"{msg.request_id}#{next(self._eids)}", msg, rec.tp, rec.offset, arrival,
                  -(-(len(msg.prompt_token_ids) + 1) // self.block_size),
                  aging_from=aging_start(arrival, now, self.aging_period_s, self.age_credit_periods),
                  block_size=self.block_size)
        if self.spans is not None:
            self.spans.begin(job, rec)
        self.ledger.add(job)
        self.next_stage.put(Arrival(job))
