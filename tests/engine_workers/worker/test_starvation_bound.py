"""The p2 starvation bound in seconds (docs/worker.md, "SLOs: the p2 bound"), under a sustained p2
backlog and a p0 load the edge admits, and the token-based wait prediction behind that admission.

Simulated time, the real pieces: the worker's intake (:class:`IntakeQueue` under the default aging
policy and age credit), the wait prediction (:func:`predict_wait`) that the edge holds against p0's
TTFT target to admit or refuse each p0 arrival, and the admission rate meter. Service is drawn
(exponential, seeded); the loop is bounded in simulated seconds and in events."""

from __future__ import annotations

import heapq
import random

import pytest

from engine_workers.engine.step_model import StepLine
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.intake.predict import MAX_PREDICTED_S, Backlog, predict_wait
from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue, RateMeter, aging_start

P = WorkerConfig("m").aging_period_s  # the defaults the bound is stated for
CREDIT = WorkerConfig("m").age_credit_periods
T0 = WorkerConfig("m").slo_ttft_ms[0] / 1000.0
PREFETCH = WorkerConfig("m").prefetch_per_tier


def simulate(p0_rate: float, slots: int = 8, service_s: float = 1.0, duration_s: float = 120.0,
             seed: int = 0) -> tuple[list[float], list[float], int, float]:
    """p0 arrivals at ``p0_rate`` (admitted only while the predicted p0 wait is within its TTFT
    target: the edge's rule), a p2 backlog (400 records enqueued long ago) fetched into the intake
    ``PREFETCH`` at a time. Returns (each admitted p2's wait from its fetch, each admitted p0's
    wait, p0 arrivals refused, the longest gap between two slot releases)."""
    assert CREDIT is not None
    rng = random.Random(seed)
    intake: IntakeQueue[tuple[int, float]] = IntakeQueue(IntakePolicy("aging", P))
    meter = RateMeter()
    done: list[float] = []  # completion instants
    free, now, refused, backlog = slots, 0.0, 0, 400
    next_p0 = rng.expovariate(p0_rate)
    p2_waits: list[float] = []
    p0_waits: list[float] = []
    last_release, gap = 0.0, 0.0
    for _ in range(200_000):  # bounded in events as well as in simulated time
        now = min(next_p0, done[0] if done else float("inf"))
        if now >= duration_s:
            break
        if done and done[0] <= next_p0:
            heapq.heappop(done)
            free += 1
            gap, last_release = max(gap, now - last_release), now
        else:
            ahead = intake.ahead_of(0, now)
            wait = predict_wait(Backlog(0, ahead, slots - free, free), None, 1, meter.rate(now))
            if wait <= T0:
                intake.push(f"p0@{now}", 0, now, None, (0, now))
            else:
                refused += 1
            next_p0 = now + rng.expovariate(p0_rate)
        while backlog and intake.depth()[2] < PREFETCH:  # the p2 partitions resume: fetch more
            backlog -= 1
            intake.push(f"p2-{backlog}", 2, aging_start(0.0, now, P, CREDIT), None, (2, now))
        while free and (p := intake.pop()) is not None:
            tier, since = p.item
            (p2_waits if tier == 2 else p0_waits).append(now - since)
            free -= 1
            meter.record(now)
            heapq.heappush(done, now + rng.expovariate(1.0 / service_s))
    return p2_waits, p0_waits, refused, gap


@pytest.mark.parametrize("p0_rate", [4.0, 8.0, 16.0, 32.0])  # half, all, 2x and 4x the 8 slots' capacity
@pytest.mark.parametrize("seed", [0, 1])
def test_a_p2_request_waits_a_bounded_number_of_seconds_from_its_fetch_under_any_admitted_p0_load(p0_rate,
                                                                                                   seed) -> None:
    """docs/worker.md: a p2 request fetched at f is admitted by f + (2 - C) P + W0 + k s, with W0
    the longest wait of an admitted p0 request (the edge holds its prediction to p0's TTFT target),
    k <= prefetch_per_tier the p2 requests ahead of it in the intake and s the longest gap between
    two slot releases; and never after a p0 request that arrived later than f + (2 - C) P."""
    p2, p0, refused, gap = simulate(p0_rate, seed=seed)
    assert len(p2) > 50, len(p2)  # the backlog keeps moving: p2 is never starved
    bound = (2 - CREDIT) * P + max(p0) + PREFETCH * gap
    assert max(p2) <= bound, (max(p2), bound)
    # in seconds, at these loads (8 slots of ~1 s): well within (2 - C) P + 2 s
    assert max(p2) <= (2 - CREDIT) * P + 4 * T0 + 2.0, max(p2)
    if p0_rate > 8.0:
        assert refused > 0  # overload: the edge refuses p0 rather than let its wait grow
    assert max(p0) < 4 * T0  # the admitted p0 wait stays near its target (the prediction is coarse)


def test_the_prediction_counts_prompt_tokens_not_requests() -> None:
    line = StepLine(0.010, 0.0001)  # 10 ms + 0.1 ms a token
    short = predict_wait(Backlog(tokens_ahead=40, requests_ahead=4, decodes=8, free_slots=8), line, 512, 2.0)
    long = predict_wait(Backlog(tokens_ahead=16_000, requests_ahead=4, decodes=8, free_slots=8), line, 512, 2.0)
    assert short == pytest.approx(0.010 + 0.0001 * 48)  # one step of 8 decodes + 40 prompt tokens
    assert long == pytest.approx(32 * (0.010 + 0.0001 * 512))  # ceil(16000 / 504) steps of a full budget
    # slots full: the turnover decides when it is the longer wait
    assert predict_wait(Backlog(0, 9, 8, 0), line, 512, 5.0) == pytest.approx(2.0)
    assert predict_wait(Backlog(0, 3, 8, 0), line, 512, 0.0) == MAX_PREDICTED_S  # no turnover measured
    assert predict_wait(Backlog(0, 0, 0, 8), None, 512, 0.0) == 0.0  # idle: no wait
    with pytest.raises(ValueError):
        predict_wait(Backlog(0, 0, 0, 8), None, 0, 0.0)
