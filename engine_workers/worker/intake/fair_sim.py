"""A discrete-event simulation of one tier shared by tenants, in simulated time. Pure.

``slots`` engine sequence slots; each tenant sends Poisson arrivals of requests that hold a slot
for a service time drawn around ``service_s`` (exponential, seeded). Admission uses the real
:class:`~engine_workers.worker.intake.IntakeQueue` with fair share on or off, so both runs see the
very same arrivals. The tests bound a light tenant's wait beside a flooding one with it.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from engine_workers.worker.intake.fair import request_cost
from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue


@dataclass(frozen=True, slots=True)
class TenantLoad:
    name: str
    rate: float  # arrivals per second
    weight: float = 1.0
    prompt_tokens: int = 100
    max_tokens: int = 100
    tier: int = 1


@dataclass(slots=True)
class TenantSample:
    tenant: str
    arrival: float
    cost: float
    service: float
    end: float
    admitted_at: float | None = None
    order: int = -1  # admission order (-1: never admitted)
    ahead_at_arrival: int = 0  # requests of its own tenant queued when it arrived
    admitted_before: int = 0  # admissions (of anyone) before it arrived

    @property
    def wait(self) -> float:
        return (self.admitted_at if self.admitted_at is not None else self.end) - self.arrival


def simulate_tenants(tenants: list[TenantLoad], fair_share: bool, duration_s: float = 60.0, slots: int = 8,
                     service_s: float = 1.0, seed: int = 0) -> list[TenantSample]:
    """Run the tenants' arrivals through one intake; one sample per arrival, in arrival order."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, TenantLoad]] = []
    for load in tenants:
        t = 0.0
        while load.rate > 0:
            t += rng.expovariate(load.rate)
            if t >= duration_s:
                break
            arrivals.append((t, load))
    arrivals.sort(key=lambda a: a[0])
    srng = random.Random(seed + 1)
    samples = [TenantSample(load.name, t, request_cost(load.prompt_tokens, load.max_tokens),
                            srng.expovariate(1.0 / service_s), duration_s) for t, load in arrivals]
    queue: IntakeQueue[TenantSample] = IntakeQueue(IntakePolicy(), fair_share=fair_share)
    queued: dict[str, int] = {}
    completions: list[float] = []
    free, i, admitted = slots, 0, 0
    while i < len(samples) or completions:
        next_arrival = samples[i].arrival if i < len(samples) else float("inf")
        next_done = completions[0] if completions else float("inf")
        now = min(next_arrival, next_done)
        if now >= duration_s:
            break
        if next_done <= next_arrival:
            heapq.heappop(completions)
            free += 1
        else:
            s, load = samples[i], arrivals[i][1]
            s.ahead_at_arrival, s.admitted_before = queued.get(s.tenant, 0), admitted
            queued[s.tenant] = s.ahead_at_arrival + 1
            queue.push(f"r{i}", load.tier, s.arrival, None, s, tenant=s.tenant, cost=s.cost, weight=load.weight)
            i += 1
        while free and (p := queue.pop()) is not None:
            p.item.admitted_at, p.item.order = now, admitted
            admitted += 1
            queued[p.item.tenant] -= 1
            free -= 1
            heapq.heappush(completions, now + p.item.service)
    return samples
