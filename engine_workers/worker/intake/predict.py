"""The time a new request waits for its first token, predicted from tokens, not request counts.

Pure: the admission hands in what it knows (the tokens queued ahead, the running decodes, the
engine's step line measured online, the per-step token budget, the slot turnover), and gets seconds
back. Used for the heartbeat's ``est_wait_s`` per tier, which the edge compares with each tier's
TTFT target (``edge/admission/shedding.py``) to refuse, early, a request that cannot meet it.

The model (docs/worker.md, "SLOs"): the engine runs steps of at most ``budget`` tokens, of which
each running decode takes one; the rest goes to prefills, in admission order. A request with
``tokens_ahead`` prompt tokens to prefill before its own (the engine's unfinished prefills, the
admitted requests not yet in the engine, the queued requests that sort before it, the records of
its tier and the tiers above still on the topic) gets its first chunk after
``ceil(tokens_ahead / (budget - decodes))`` steps, each lasting ``line.seconds(budget)``. Slots
bound it too: when no sequence slot is free, it waits for ``ahead + 1 - free`` slots to turn over
at the measured rate. The prediction is the larger of the two (the tighter resource decides).
A request-count estimate (the one this replaced) treats a 4,000-token prompt like a 10-token
one; the token count is what a step's time depends on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_workers.engine.step_model import StepLine

MAX_PREDICTED_S = 3600.0  # the heartbeat carries finite numbers only


@dataclass(frozen=True, slots=True)
class Backlog:
    """What lies ahead of a new request at one worker."""

    tokens_ahead: int  # prompt tokens to prefill before its own
    requests_ahead: int  # requests that must take a sequence slot before it
    decodes: int  # running sequences, one token each per step
    free_slots: int  # sequence slots free now


def predict_wait(backlog: Backlog, line: StepLine | None, budget: int, slot_rate: float) -> float:
    """Seconds until a request behind ``backlog`` runs its first chunk. ``line``: the step time
    (None before it was measured: the token term is then 0); ``budget``: tokens per step;
    ``slot_rate``: sequence slots freed per second (0: none measured)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    token_wait = 0.0
    if line is not None and backlog.tokens_ahead > 0:
        per_step = max(1, budget - backlog.decodes)
        steps = math.ceil(backlog.tokens_ahead / per_step)
        token_wait = steps * line.seconds(min(budget, backlog.decodes + backlog.tokens_ahead))
    slot_wait = 0.0
    need = backlog.requests_ahead + 1 - backlog.free_slots
    if need > 0:
        slot_wait = need / slot_rate if slot_rate > 0 else MAX_PREDICTED_S
    return min(MAX_PREDICTED_S, max(token_wait, slot_wait))
