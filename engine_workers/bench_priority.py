"""``lockgate bench priority``: the same overload under fifo, strict and aging intake.

A discrete-event simulation of one worker: ``slots`` engine sequence slots, each request holding
one for a service time drawn around ``service_s`` (exponential, seeded), Poisson arrivals per tier.
Admission uses the real :class:`~engine_workers.intake.IntakeQueue` (the worker's own code), so
what differs between runs is only the policy. Simulated time makes the comparison exact and fast:
a minute of overload takes milliseconds, and every mode sees the very same arrivals.

Prints p50/p99 waiting time (arrival to admission; requests never admitted count their wait up
to the end of the run) per tier and mode, and writes a PNG plot (matplotlib, Agg) of each
request's waiting time against its arrival time, one panel per mode, to ``--out``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from dataclasses import dataclass

from engine_workers.intake import IntakePolicy, IntakeQueue

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
    queue: IntakeQueue[Sample] = IntakeQueue(IntakePolicy(mode, load.aging_period_s))
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


def summarize(results: dict[str, list[Sample]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode, samples in results.items():
        out[mode] = {}
        for tier in range(3):
            w = tier_waits(samples, tier)
            admitted = sum(1 for s in samples if s.tier == tier and s.admitted_at is not None)
            out[mode][f"p{tier}"] = {"n": len(w), "admitted": admitted, "p50": percentile(w, 0.5),
                                     "p99": percentile(w, 0.99), "max": max(w) if w else float("nan")}
    return out


def plot(results: dict[str, list[Sample]], load: Overload, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), sharey=True)
    colors = ("tab:red", "tab:blue", "tab:green")
    for ax, (mode, samples) in zip(axes, results.items()):
        for tier in range(3):
            pts = [(s.arrival, s.wait) for s in samples if s.tier == tier]
            if pts:
                ax.scatter(*zip(*pts), s=4, color=colors[tier], label=f"p{tier}", alpha=0.7)
        ax.set_title(f"{mode}" + (f" (P={load.aging_period_s:g}s)" if mode == "aging" else ""))
        ax.set_xlabel("arrival time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("waiting time (s)")
    axes[0].legend(markerscale=3)
    cap = load.slots / load.service_s
    fig.suptitle(f"offered {sum(load.rates):g} req/s vs capacity {cap:g} req/s for {load.overload_s:g} s "
                 f"(p0 {load.rates[0]:g}, p1 {load.rates[1]:g}, p2 {load.rates[2]:g}), then x{load.relief:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    load = Overload(args.duration, args.slots, args.service_time, (args.p0_rate, args.p1_rate, args.p2_rate),
                    args.aging_period, args.seed, args.overload, args.relief)
    results = {m: simulate(m, load) for m in MODES}
    summary = summarize(results)
    cap = load.slots / load.service_s
    if args.json:
        print(json.dumps({"load": {"offered": sum(load.rates), "capacity": cap}, "summary": summary}))
    else:
        print(f"overload: offered {sum(load.rates):g} req/s (p0 {load.rates[0]:g} / p1 {load.rates[1]:g} / "
              f"p2 {load.rates[2]:g}) vs capacity {cap:g} req/s for {load.overload_s:g} s, then x{load.relief:g} "
              f"until {load.duration_s:g} s; aging period {load.aging_period_s:g} s (simulated service time)")
        print(f"{'mode':8} {'tier':4} {'n':>5} {'admitted':>8} {'wait p50 s':>11} {'wait p99 s':>11} {'max s':>8}")
        for mode, tiers in summary.items():
            for tier, st in tiers.items():
                print(f"{mode:8} {tier:4} {st['n']:5d} {st['admitted']:8d} {st['p50']:11.2f} {st['p99']:11.2f} "
                      f"{st['max']:8.2f}")
        a0, f0 = summary["aging"]["p0"]["p50"], summary["fifo"]["p0"]["p50"]
        print(f"p0 wait p50: fifo/aging = {f0 / a0 if a0 else float('inf'):.2f}x; "
              f"p2 max wait: strict {summary['strict']['p2']['max']:.1f}s vs aging {summary['aging']['p2']['max']:.1f}s")
    if args.out:
        plot(results, load, args.out)
        print(f"plot written to {args.out}", file=sys.stderr)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    d = Overload()
    p.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds")
    p.add_argument("--slots", type=int, default=d.slots, help="engine sequence slots")
    p.add_argument("--service-time", type=float, default=d.service_s, help="mean seconds a request holds a slot")
    p.add_argument("--p0-rate", type=float, default=d.rates[0])
    p.add_argument("--p1-rate", type=float, default=d.rates[1])
    p.add_argument("--p2-rate", type=float, default=d.rates[2])
    p.add_argument("--aging-period", type=float, default=d.aging_period_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--overload", type=float, default=d.overload_s, help="seconds of overload before the rates drop")
    p.add_argument("--relief", type=float, default=d.relief, help="rate factor after the overload")
    p.add_argument("--out", default="priority.png", help="PNG plot path ('' = none)")
    p.add_argument("--json", action="store_true")
