"""``lockgate bench engine``: one seeded heterogeneous workload through several engines, one run.

Engines (rows): lockgate; lockgate's ablation (``--no-weight-prepack --no-cpu-kernels``: the
engine's design, continuous batching over a paged KV cache with chunked prefill, without its CPU
kernels; CPU only, ``--no-ablation`` skips it); HF ``generate()`` in padded static batches of 8; and
transformers' own continuous batching (benchmarks/engine/hf_baselines.py). Each engine lives in a process
of its own and the engines run one at a time (benchmarks/engine/procs.py says why), every one with
the same torch thread count (lockgate's: ``--threads`` or torch's default) and the same untimed
warm-up (4 short requests) after its set-up. EOS is ignored so every engine makes exactly the
requested tokens. ``--dtype`` / ``--quantization`` and every other engine flag reach lockgate and
its ablation through ``lockgate.options.engine_config_from_args`` (recorded as ``engine_config``);
the HF rows follow ``--dtype`` where plain transformers can (:func:`hf_precision`).

The workload is the anchors' (vLLM / llama.cpp, shared/anchors/README.md, "Workload") for the
default 32 requests and seed 0 with SmolLM2's vocabulary: prompts of 8..256 random ids from 3 up,
outputs of 8..96 tokens, greedy, no BOS; ``workload_sha256_16`` is their fingerprint.

Recorded: the machine (benchmarks/machine.py); output tokens/s of each engine and lockgate's ratio
to each; lockgate's share of the machine's roofline (fp32 GEMM FLOP/s measured in the same run vs
the model FLOPs lockgate executed per second); and, at lockgate's KV budget, how many of the
workload's sequences fit at once paged vs reserved contiguously at prompt + max_tokens each.
``--repeat N`` runs N rounds of everything, rotating which engine goes first, and each keeps its
best: symmetric, so noise favours no engine. ``--table-row`` also prints a Markdown row for docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from types import SimpleNamespace

import torch

from benchmarks.engine.roofline import measure_gemm_flops, model_flops
from benchmarks.engine.workload import ANCHOR_WORKLOAD_SHA256_16, Workload, capacity, make_workload
from benchmarks.machine import loadavg, machine_info

__all__ = ["Workload", "make_workload", "machine_info", "measure_gemm_flops", "model_flops", "capacity", "run"]

log = logging.getLogger(__name__)

WARMUP_REQUESTS = 4


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work: a timer read before that would stop early on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ablation_skip_reason(config, device_type: str) -> str | None:
    if device_type != "cpu":
        return f"--no-weight-prepack/--no-cpu-kernels are CPU options; nothing to ablate on {device_type}"
    if not config.weight_prepack and not config.cpu_kernels:
        return "lockgate already runs with --no-weight-prepack --no-cpu-kernels"
    return None


def run(args: argparse.Namespace) -> int:
    from benchmarks.engine.hf_baselines import hf_precision
    from benchmarks.engine.procs import EngineProc, EngineProcError, ProcSpec, timed_run
    from benchmarks.engine.report import print_report, table
    from lockgate.options import engine_config_from_args

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    config = engine_config_from_args(args)
    machine = machine_info()  # before any engine loads: the load average is the other users'
    device_type = torch.device(config.resolved_device()).type
    level = logging.getLogger().getEffectiveLevel()
    skip_ablation = "--no-ablation" if not args.ablation else ablation_skip_reason(config, device_type)
    specs = [ProcSpec("lockgate", "lockgate", config, log_level=level)]
    if skip_ablation is None:
        specs.append(ProcSpec("lockgate_ablation", "lockgate",
                              dataclasses.replace(config, weight_prepack=False, cpu_kernels=False), log_level=level))
    procs: list[EngineProc] = []
    errors: dict[str, str] = {}
    try:
        procs = [EngineProc(s) for s in specs]
        infos = {p.name: p.ready() for p in procs}
        lg = infos["lockgate"]
        machine["kernel_isa"] = lg.get("kernel_isa")  # as the engine's own process chose it
        wl = make_workload(lg["spec"].vocab_size, args.num_requests, args.seed)
        hf_dtype, hf_note = hf_precision(config, device_type)
        if not args.skip_hf:
            hf = [EngineProc(ProcSpec(name, kind, config, model_path=lg["model"], hf_dtype=hf_dtype, threads=lg["threads"],
                                      max_new_tokens=max(wl.outputs), kv_tokens=lg["kv_blocks"] * lg["block_size"],
                                      log_level=level))
                  for name, kind in (("hf_static_b8", "hf_static"), ("hf_continuous", "hf_continuous"))]
            for p in hf:
                try:
                    infos[p.name] = p.ready()
                    procs.append(p)
                except EngineProcError as exc:  # report, do not hide: that comparison is then missing
                    errors[p.name] = str(exc)
                    p.close()

        def guarded(p: EngineProc, fn):
            try:
                return fn()
            except EngineProcError as exc:
                if p.spec.kind == "lockgate":
                    raise
                log.error("%s", exc)
                errors[p.name] = str(exc)
                return None

        # The same untimed warm-up for every engine, one at a time: first calls pay one-time costs.
        warm = make_workload(lg["spec"].vocab_size, WARMUP_REQUESTS, args.seed + 1, (8, 32), (4, 8))
        warmup_s = {p.name: guarded(p, lambda p=p: p.call("run", warm)["seconds"]) for p in procs}

        # Rounds of every measurement, each round starting with the next engine; each keeps its best
        # (fastest run, highest GEMM rate), so on a noisy machine none is compared on a luckier draw.
        peaks: dict[str, float] = {}
        runs: dict[str, list[dict]] = {p.name: [] for p in procs}
        for r in range(args.repeat):
            if device_type == "cpu":
                for path, rate in procs[0].call("gemm").items():
                    peaks[path] = max(peaks.get(path, 0.0), rate)
            for p in procs[r % len(procs):] + procs[: r % len(procs)]:
                if p.name not in errors:
                    out = guarded(p, lambda p=p: timed_run(p, [o for o in procs if o is not p], wl))
                    if out is not None:
                        runs[p.name].append(out)
    finally:
        for p in procs:
            p.close()
    machine["loadavg_1_5_15_at_end"] = loadavg()

    results: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": machine, "model": lg["model"],
        "device": lg["device"], "dtype": lg["dtype"], "weights": lg["weights"], "quantization": config.quantization,
        "kv_cache_dtype": lg["kv_cache_dtype"],
        "engine_config": dataclasses.asdict(config), "threads": lg["threads"], "requests": len(wl.prompts),
        "prompt_tokens": wl.prompt_tokens, "output_tokens": wl.output_tokens, "seed": args.seed,
        "workload_sha256_16": wl.fingerprint(), "workload_is_anchors": wl.fingerprint() == ANCHOR_WORKLOAD_SHA256_16,
        "repeat": args.repeat, "warmup_requests": WARMUP_REQUESTS,
        "isolation": "each engine in its own process, one running at a time; others_cpu_s_max = the most CPU "
                     "seconds any waiting engine process used during one of its runs",
    }
    gemm = max(peaks.values()) if peaks else None
    results["gemm_flops"] = gemm
    results["gemm_flops_by_path"] = peaks or None
    spec = SimpleNamespace(**{f.name: getattr(lg["spec"], f.name) for f in dataclasses.fields(lg["spec"])})
    seq_lens = [len(p) + m for p, m in zip(wl.prompts, wl.outputs)]
    for p in procs:
        info, mine = infos[p.name], runs[p.name]
        if p.name in errors or not mine:
            results[p.name] = {"error": errors.get(p.name, "no run")}
            continue
        best = min(mine, key=lambda o: o["seconds"])
        row = {"seconds": best["seconds"], "tokens_per_s": wl.output_tokens / best["seconds"],
               "all_seconds": [o["seconds"] for o in mine], "others_cpu_s_max": max(o["others_cpu_s"] for o in mine),
               "warmup_s": warmup_s[p.name], "setup_s": info["setup_s"], "threads": info["threads"], "dtype": info["dtype"]}
        if p.spec.kind == "lockgate":
            flops = model_flops(spec, best["computed_tokens"], wl.output_tokens, seq_lens)
            row.update(weights=info["weights"], computed_tokens=best["computed_tokens"], model_flops_per_s=flops / best["seconds"],
                       weight_prepack=p.spec.config.weight_prepack, cpu_kernels=p.spec.config.cpu_kernels)
            if "step_breakdown" in best:  # CUDA: host vs device per forward (benchmarks/engine/steptime.py)
                row["step_breakdown"] = best["step_breakdown"]
            if gemm:
                row["roofline_share"] = flops / best["seconds"] / gemm
                row["roofline_share_by_path"] = {k: flops / best["seconds"] / v for k, v in peaks.items()}
        else:
            row["precision"] = hf_note
            if info.get("kv_tokens"):
                row["kv_tokens"] = info["kv_tokens"]
        results[p.name] = row
    for name in errors:
        results.setdefault(name, {"error": errors[name]})
    if skip_ablation is not None:
        results["lockgate_ablation"] = {"skipped": skip_ablation}
    if args.skip_hf:
        results["hf_skipped"] = "--skip-hf"
    for key in ("lockgate_ablation", "hf_static_b8", "hf_continuous"):
        if "tokens_per_s" in results.get(key, {}) and "tokens_per_s" in results["lockgate"]:
            results[f"speedup_vs_{key}"] = results["lockgate"]["tokens_per_s"] / results[key]["tokens_per_s"]
    results["capacity"] = capacity(wl, lg["kv_blocks"], lg["block_size"], lg["max_model_len"])
    results["table_header"], results["table_row"] = table(results)

    if args.json:  # the table row is in the JSON
        print(json.dumps(results, indent=2))
        return 0
    print_report(results)
    if args.table_row:
        print(results["table_header"])
        print(results["table_row"])
    return 0
