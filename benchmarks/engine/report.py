"""The printout of ``lockgate bench engine`` and its Markdown table row for docs/benchmarks.md,
both from the results dict benchmarks/engine/bench.py builds (the JSON the command prints with --json)."""

from __future__ import annotations

from benchmarks.machine import describe

ROWS = (("lockgate", "lockgate"), ("lockgate_ablation", "lockgate, no kernels"),
        ("hf_static_b8", "HF static b8"), ("hf_continuous", "HF continuous"))


def _load(m: dict, key: str) -> str:
    v = m.get(key)
    return "/".join(f"{x:.1f}" for x in v) if v else "?"


def table(r: dict) -> tuple[str, str]:
    """(header lines, one row): when, where, what ran, each engine's best seconds (tok/s) and
    lockgate's speed-up over each, the load average at start and end (a shared machine's figures
    are marked by it)."""
    m = r["machine"]
    cells = [r["date_utc"], f"{m['cpu_model']}, {m['usable_cores']} cores", f"{r['weights']} ({r['device']}, {r['threads']} thr)",
             f"{r['requests']} req, {r['prompt_tokens']}+{r['output_tokens']} tok"]
    for key, _ in ROWS:
        e = r.get(key, {})
        cells.append(f"{e['seconds']:.2f} ({e['tokens_per_s']:.0f})" if "seconds" in e else "—")
    for key, _ in ROWS[1:]:
        cells.append(f"{r[f'speedup_vs_{key}']:.2f}×" if f"speedup_vs_{key}" in r else "—")
    share = r["lockgate"].get("roofline_share")
    cells.append(f"{share:.0%}" if share is not None else "—")
    cells.append(f"{_load(m, 'loadavg_1_5_15_at_start')} → {_load(m, 'loadavg_1_5_15_at_end')}")
    names = ["date (UTC)", "CPU", "lockgate weights", "workload"] + [f"{label} s (tok/s)" for _, label in ROWS] \
        + [f"× {label}" for _, label in ROWS[1:]] + ["roofline", "load 1/5/15 start → end"]
    header = "| " + " | ".join(names) + " |\n|" + "|".join("---" if i < 4 else "---:" for i in range(len(names) - 1)) + "|---|"
    return header, "| " + " | ".join(cells) + " |"


def print_report(r: dict) -> None:
    print(f"workload: {r['requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens "
          f"(seed {r['seed']}, sha256/16 {r['workload_sha256_16']}"
          f"{', = the anchors workload' if r['workload_is_anchors'] else ''}); {r['model']} on {r['device']}, "
          f"lockgate {r['dtype']} (weights {r['weights']}, KV cache {r['kv_cache_dtype']}), "
          f"{r['threads']} threads for every engine")
    print(describe(r["machine"]) + f", at end {_load(r['machine'], 'loadavg_1_5_15_at_end')}")
    print(f"each engine in its own process, one at a time, after the same {r['warmup_requests']}-request warm-up"
          + (f"; {r['repeat']} rounds, the first engine rotating, each keeps its best" if r["repeat"] > 1 else ""))
    print(f"{'engine':<22}{'seconds':>9}{'out tok/s':>11}{'warm-up s':>11}{'idle others CPU s':>19}  precision")
    for key, label in ROWS:
        e = r.get(key)
        if e is None:
            continue
        if "seconds" not in e:
            print(f"{label:<22}  {'skipped: ' + e['skipped'] if 'skipped' in e else 'failed: ' + e['error']}")
            continue
        prec = e.get("precision") or f"{e['dtype']}, weights {e['weights']}"
        if key == "lockgate_ablation":
            prec += ", --no-weight-prepack --no-cpu-kernels"
        print(f"{label:<22}{e['seconds']:>9.2f}{e['tokens_per_s']:>11.1f}{e['warmup_s'] or 0:>11.2f}"
              f"{e['others_cpu_s_max']:>19.2f}  {prec}")
    if "hf_skipped" in r:
        print("HF engines: skipped (--skip-hf)")
    for key, label in ROWS[1:]:
        if f"speedup_vs_{key}" in r:
            print(f"lockgate vs {label}: {r[f'speedup_vs_{key}']:.2f}x")
    lg = r["lockgate"]
    if r["gemm_flops"] and "roofline_share" in lg:
        by_path = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r["gemm_flops_by_path"].items())
        print(f"fp32 GEMM peak (1024^3, this run, GFLOP/s): {by_path}; roofline = the faster, {r['gemm_flops'] / 1e9:.1f}")
        shares = ", ".join(f"{v:.0%} of {k}" for k, v in lg["roofline_share_by_path"].items())
        print(f"lockgate executed {lg['model_flops_per_s'] / 1e9:.1f} GFLOP/s of model FLOPs = "
              f"{lg['roofline_share']:.0%} of roofline ({shares})")
    for key, label in ROWS[:2]:
        sb = r.get(key, {}).get("step_breakdown")
        if sb and sb.get("forwards"):
            graphs = f"; graph replays {sb['graph_counts'].get('replay', 0)}" if "graph_counts" in sb else ""
            print(f"{label} step time per forward ({sb['forwards']} forwards): wall {sb['wall_ms_per_forward']:.2f} ms = "
                  f"host in forward {sb['forward_host_ms']:.2f} ms, device span {sb['forward_device_ms']:.2f} ms, "
                  f"outside the forward ~{sb['outside_forward_ms']:.2f} ms{graphs}")
    c = r["capacity"]
    print(f"KV capacity at {c['kv_blocks']} blocks x {c['block_size']} ({c['kv_tokens']} tokens): paged "
          f"{c['paged_sequences']} sequences vs {c['contiguous_sequences']} reserved contiguously at prompt + "
          f"max_tokens ({c['mean_sequence_tokens']:.1f} tokens each on average) -> {c['ratio']:.2f}x "
          f"(EOS ignored: every sequence fills its reservation; at max_model_len {c['max_model_len']}: "
          f"{c['contiguous_sequences_at_max_model_len']})")
