"""``lockgate bench priority``: the same overload under fifo, strict and aging intake.

A discrete-event simulation of one worker: ``slots`` engine sequence slots, each request holding
one for a service time drawn around ``service_s`` (exponential, seeded), Poisson arrivals per tier.
Admission uses the real :class:`~engine_workers.worker.intake.IntakeQueue` (the worker's own code), so
what differs between runs is only the policy. Simulated time makes the comparison exact and fast:
a minute of overload takes milliseconds, and every mode sees the very same arrivals.

Prints p50/p99 waiting time (arrival to admission; requests never admitted count their wait up
to the end of the run) per tier and mode, and writes a PNG plot (matplotlib, Agg) of each
request's waiting time against its arrival time, one panel per mode, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine_workers.worker.intake.queue_sim import (
    MODES,
    Overload,
    Sample,
    percentile,
    simulate,
    tier_waits,
)


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
