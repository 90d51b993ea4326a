"""The pipeline's fourth stage: the intake's checks, the last word before a request is queued.

A request whose reply topic exists (and, when another worker may have started it, whose published
tokens are known) is answered at once when it cannot run here (wrong model -> ``invalid_request``;
cancelled earlier -> ``Finished(abort)``; past its deadline -> ``expired``), else handed to the
intake queue. A request re-run after its replies failed (``pipeline/failures.py``) enters the
pipeline here: these checks apply to it again.

Concurrency: event loop only.
"""

from __future__ import annotations

import time

from bus import ErrorCode, FinishReason, safe_name
from engine_workers.worker.aborts import Aborts
from engine_workers.worker.pipeline.handoff import Arrival, Serving, Stage
from engine_workers.worker.replies.answers import Answers


class IntakeChecks:
    """``model``: the served model's name; ``aborts``: its recent cancels; ``next_stage``: the
    intake queue (admission)."""

    def __init__(self, model: str, serving: Serving, aborts: Aborts, answers: Answers, next_stage: Stage) -> None:
        self.model = model
        self._safe_model = safe_name(model)
        self.serving = serving
        self.aborts = aborts
        self.answers = answers
        self.next_stage = next_stage

    def put(self, arrival: Arrival) -> None:
        if not self.serving.on:
            return  # draining or stopped: stays uncommitted for the next owner
        job = arrival.job
        msg, now = job.req, time.time()
        if safe_name(msg.model) != self._safe_model:
            self.answers.error(job, ErrorCode.INVALID_REQUEST, f"model {msg.model!r} is not served here ({self.model!r})")
        elif self.aborts.cancelled(msg.request_id):
            self.answers.unrun(job, FinishReason.ABORT)
        elif msg.deadline is not None and msg.deadline <= now:
            self.answers.error(job, ErrorCode.EXPIRED, f"deadline passed {now - msg.deadline:.3f}s before intake")
        else:
            self.next_stage.put(arrival)
