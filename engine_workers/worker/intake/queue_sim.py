"""A discrete-event simulation of one worker's intake under overload, in simulated time.

``slots`` engine sequence slots, each request holding one for a service time drawn around
``service_s`` (exponential, seeded), Poisson arrivals per tier. Admission uses the real
:class:`~engine_workers.worker.intake.IntakeQueue`, so what differs between runs is only the
policy, and every policy sees the very same arrivals. Pure: no clock, no I/O. The tests bound
starvation with it and ``lockgate bench priority`` prints and plots it.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue, parse_intake_mode

MODES = ("fifo", "strict", "aging")


@dataclass(frozen=True, slots=True)
class Overload:
    duration_s: float = 120.0
    slots: int = 8
    service_s: float = 1.0
    rates: tuple[float, float, float] = (7.0, 1.0, 2.0)  # arrivals per second, per tier, during the overload
    aging_period_s: float = 2.0
    seed: int = 0
    overload_s: float = 40.0  # then the rates drop by ``relief`` and the queues drain
    relief: float = 0.5


@dataclass(slots=True)
class Sample:
    tier: int
    arrival: float
    end: float  # end of the run (wait of a request never admitted counts to here)
    service: float  # seconds it holds a slot once admitted
    admitted_at: float | None = None

    @property
    def wait(self) -> float:
        return (self.admitted_at if self.admitted_at is not None else self.end) - self.arrival


def _arrivals(load: Overload) -> list[tuple[float, int]]:
    rng = random.Random(load.seed)
    out = []
    for tier, rate in enumerate(load.rates):
        t = 0.0
        while rate > 0:
            r = rate if t < load.overload_s else rate * load.relief
            if r <= 0:
                break
            t += rng.expovariate(r)
            if t >= load.duration_s:
                break
            out.append((t, tier))
    return sorted(out)


def simulate(mode: str, load: Overload) -> list[Sample]:
    """Run ``load`` under ``mode``; returns one :class:`Sample` per arrival, in arrival order."""
    rng = random.Random(load.seed + 1)
    queue: IntakeQueue[Sample] = IntakeQueue(IntakePolicy(parse_intake_mode(mode), load.aging_period_s))
    samples = [Sample(tier, t, load.duration_s, rng.expovariate(1.0 / load.service_s)) for t, tier in _arrivals(load)]
    completions: list[float] = []
    free = load.slots
    i = 0
    while i < len(samples) or completions:
        next_arrival = samples[i].arrival if i < len(samples) else float("inf")
        next_done = completions[0] if completions else float("inf")
        now = min(next_arrival, next_done)
        if now >= load.duration_s:
            break
        if next_done <= next_arrival:
            heapq.heappop(completions)
            free += 1
        else:
            s = samples[i]
            queue.push(f"r{i}", s.tier, s.arrival, None, s)
            i += 1
        while free and (p := queue.pop()) is not None:
            p.item.admitted_at = now
            free -= 1
            heapq.heappush(completions, now + p.item.service)
    return samples


def tier_waits(samples: list[Sample], tier: int) -> list[float]:
    return [s.wait for s in samples if s.tier == tier]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]
