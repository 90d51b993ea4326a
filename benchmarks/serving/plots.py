"""PNG plots of a ``bench serve`` result (matplotlib, Agg backend; imported only here).

* ``latency_cdf_rate-<r>.png`` per offered rate: 2x2 empirical CDFs of TTFT, TPOT, ITL and E2E
  (ms), one line per tier;
* ``throughput_vs_rate.png``: request throughput and goodput (req/s) and output tokens/s against
  the offered rate.

Input is the ``results.json`` dict written by :mod:`benchmarks.serving.serve` (``runs[*].requests``
holds the per-request samples). Returns the paths written.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.stats import cdf_points

METRICS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E latency (ms)"))


def _rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for run in result["runs"]:
        reqs = [r for r in run["requests"] if r["ok"]]
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for ax, (key, title) in zip(axes.flat, METRICS):
            tiers = sorted({r["tier"] for r in reqs})
            for tier in tiers:
                if key == "itl_ms":
                    vals = [g for r in reqs if r["tier"] == tier for g in r["itl_ms"]]
                else:
                    vals = [r[key] for r in reqs if r["tier"] == tier and r[key] is not None]
                if vals:
                    xs, ys = cdf_points(vals)
                    ax.step(xs, ys, where="post", label=f"p{tier} (n={len(vals)})")
            ax.set_title(title)
            ax.set_xlabel("ms")
            ax.set_ylabel("CDF")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.suptitle(f"lockgate bench serve: latency CDFs at {_rate_label(run['rate'])} req/s ({result['config']['target']})")
        fig.tight_layout()
        path = out_dir / f"latency_cdf_rate-{_rate_label(run['rate'])}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    runs = result["runs"]
    finite = [r for r in runs if r["rate"] != float("inf")]
    xs = [r["rate"] for r in finite] or list(range(len(runs)))
    src = finite or runs
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(xs, xs, ":", color="grey", label="offered")
    a1.plot(xs, [r["stats"]["request_throughput"] for r in src], "o-", label="throughput")
    if any(r["stats"]["goodput"] is not None for r in src):
        a1.plot(xs, [r["stats"]["goodput"] or 0.0 for r in src], "s-", label="goodput (SLO)")
    a1.set_xlabel("offered rate (req/s)")
    a1.set_ylabel("req/s")
    a1.set_title("request throughput and goodput")
    a1.grid(alpha=0.3)
    a1.legend()
    a2.plot(xs, [r["stats"]["output_throughput"] for r in src], "o-", label="output tok/s")
    a2.set_xlabel("offered rate (req/s)")
    a2.set_ylabel("tokens/s")
    a2.set_title("output token throughput")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "throughput_vs_rate.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written
