"""The PNGs of ``lockgate bench goodput`` (:mod:`benchmarks.serving.goodput`): TTFT and TPOT
percentiles against the offered rate, goodput against the rate (both servers), and the mixed-tier
run. matplotlib is optional: without it no PNG is written (the JSON has every number)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)
COLORS = {"lockgate": "tab:blue", "vllm": "tab:orange"}


def plot_all(result: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNGs (results.json has the numbers)")
        return []
    written = []
    rates = result.get("rates", {})
    slo = result.get("slo_ms", {})
    when = f"{result.get('host', {}).get('cpu', '')}, {result.get('host', {}).get('date', '')}"
    if rates:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for name, rows in rates.items():
                x = [r["request_rate"] for r in rows]
                ax.plot(x, [r[f"median_{metric}_ms"] for r in rows], "o--", color=COLORS.get(name), label=f"{name} p50")
                ax.plot(x, [r[f"p99_{metric}_ms"] for r in rows], "s-", color=COLORS.get(name), label=f"{name} p99")
            if metric in slo:
                ax.axhline(slo[metric], color="gray", lw=0.8, ls=":", label=f"SLO {slo[metric]:g} ms")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_ylabel(f"{metric.upper()} (ms)")
            ax.legend(fontsize=7)
        fig.suptitle(f"vllm bench serve against lockgate serve and vllm serve ({when})", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out / "latency_vs_rate.png", plt))
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        for name, rows in rates.items():
            x = [r["request_rate"] for r in rows]
            ax.plot(x, [r["request_goodput"] for r in rows], "o-", color=COLORS.get(name), label=f"{name} goodput")
            ax.plot(x, [r["request_throughput"] for r in rows], "x:", color=COLORS.get(name), label=f"{name} completed")
        ax.plot(x, x, color="gray", lw=0.8, ls=":", label="offered")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("req/s")
        ax.set_title(f"goodput (TTFT {slo.get('ttft', 0):g} ms, TPOT {slo.get('tpot', 0):g} ms)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "goodput_vs_rate.png", plt))
    mixed = result.get("mixed")
    if mixed:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        p0 = mixed["p0"]
        axes[0].bar(["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"],
                    [p0["median_ttft_ms"], p0["p99_ttft_ms"], p0["median_tpot_ms"], p0["p99_tpot_ms"]], color="tab:blue")
        for target in (slo.get("ttft"), slo.get("tpot")):
            if target:
                axes[0].axhline(target, color="gray", lw=0.8, ls=":")
        axes[0].set_yscale("log")
        axes[0].set_ylabel("ms")
        axes[0].set_title(f"p0 at {mixed['p0_rate']:g} req/s beside saturating p2: goodput "
                          f"{p0['good_share']:.0%} of requests", fontsize=8)
        axes[1].bar(["p2 alone", "p2 beside p0"], [mixed["p2_solo"]["output_throughput"],
                                                   mixed["p2_with_p0"]["output_throughput"]], color="tab:gray")
        axes[1].set_ylabel("p2 output tokens/s")
        axes[1].set_title(f"p2 keeps {mixed['p2_throughput_share']:.0%} of its solo throughput", fontsize=8)
        fig.suptitle(f"lockgate serve, mixed tiers ({when})", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out / "mixed_tier.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
