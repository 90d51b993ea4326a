"""``lockgate bench engine``: one seeded heterogeneous workload through three engines, one run.

(a) HF ``generate()`` in padded static batches of 8 (left padding; a batch runs until its longest
    request is done), (b) transformers' own continuous batching (its ``ContinuousBatchingManager``,
    per-request ``max_new_tokens``), (c) lockgate. Every engine runs on the engine's device in its
    compute dtype (fp32 on a CPU, bf16 on CUDA by default), EOS ignored so every engine produces
    exactly the requested tokens. ``--dtype bfloat16`` / ``--quantization int8`` on a CPU change
    lockgate's linear weights only (the HF engines stay fp32: their bf16 CPU path is torch's slow
    bf16 GEMM, not a like-for-like comparison).

The JSON and the printout name the machine (:func:`machine_info`: CPU model and flags, cores,
torch and oneDNN versions, load average at the start).

Printed: output tokens/s of each and the ratios; lockgate's share of the machine's roofline (fp32
GEMM FLOP/s measured in the same run vs the model FLOPs lockgate actually executed per second);
and, at one KV budget, how many of the workload's sequences fit at once with paged blocks vs with
contiguous reservation at max length. ``--repeat N`` runs N rounds of everything (GEMM peak, lockgate,
both HF modes) and keeps each one's best: symmetric, so noise favours no engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass

import torch

from engine_workers.engine.params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)


def make_workload(vocab: int, n: int, seed: int, prompt_range=(8, 256), output_range=(8, 96), low: int = 3) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, outputs)


def measure_gemm_flops(dtype=torch.float32, n: int = 1024, seconds: float = 1.5) -> dict[str, float]:
    """fp32 GEMM FLOP/s of this machine, ``n``-cubed, by each path this process can use: plain
    ``torch.mm`` (the BLAS every HF model runs on) and, where available, oneDNN with the weight
    packed once (what lockgate's CPU linears use, engine_workers/kernels/cpu_linear.py). The machine's
    roofline is the faster of the two: on some CPUs (AMD, where the BLAS is not tuned) the two
    differ by more than 2x."""
    from engine_workers.kernels.cpu_linear import PackedLinear, packing_problem

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)

    def rate(fn) -> float:
        fn()
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            iters += 1
        return 2 * n**3 * iters / (time.perf_counter() - start)

    out = {"torch_mm": rate(lambda: torch.mm(a, b))}
    if packing_problem(torch.device("cpu"), dtype) is None:
        packed = PackedLinear.from_weight(b)
        out["onednn_packed"] = rate(lambda: packed(a))
    return out


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work: a timer read before that would stop early on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_model(path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    # The same device and dtype as lockgate's engine: a GPU engine against HF on the CPU (as this
    # bench ran until 2026-12-04 on CUDA, never tried there) would compare hardware, not engines.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]  # PreTrainedModel.to is functools.wraps'd; typeshed's _Wrapped does not bind self
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(model, wl: Workload, batch: int = 8) -> float:
    from transformers import GenerationConfig

    pad = 0
    device = model.device
    sync_device(device)
    start = time.perf_counter()
    for i in range(0, len(wl.prompts), batch):
        prompts, outs = wl.prompts[i : i + batch], wl.outputs[i : i + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        cfg = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=None, pad_token_id=pad)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=cfg)
    sync_device(device)
    return time.perf_counter() - start


def run_hf_continuous(model, wl: Workload) -> float:
    """Seconds from the first request added to the last result. The manager's set-up (entering
    the context: its cache allocation, seconds even for a tiny model) and tear-down are not timed,
    as lockgate's engine construction is not."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(wl.outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m) for i, (p, m) in enumerate(zip(wl.prompts, wl.outputs))]
        pending = set(ids)
        deadline = time.monotonic() + 3600
        while pending and time.monotonic() < deadline:
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                pending.discard(res.request_id)
        elapsed = time.perf_counter() - start
        if pending:
            raise RuntimeError(f"HF continuous batching left {len(pending)} requests unfinished")
    return elapsed


def run_lockgate(engine, wl: Workload) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.outputs]
    computed0 = engine.stats.computed_tokens
    sync_device(engine.device)
    start = time.perf_counter()
    # A fresh prefix-cache salt per run: an earlier round's cached prompts must not make a later
    # round cheaper (the HF engines have no cache to reuse).
    done = engine.generate(wl.prompts, params, cache_salt=uuid.uuid4().hex)
    sync_device(engine.device)
    elapsed = time.perf_counter() - start
    assert [len(d.token_ids) for d in done] == wl.outputs
    if any(d.num_cached_tokens for d in done):
        raise RuntimeError("bench run reused cached prefixes; its timing would not be comparable")
    return elapsed, engine.stats.computed_tokens - computed0


def model_flops(spec, computed_tokens: int, sampled_tokens: int, seq_lens: list[int]) -> float:
    """FLOPs of the model work a run did: every linear layer for each computed token, the LM head
    for each sampled token, and attention (QK^T and PV) exactly: a sequence of final length ``L``
    computes positions ``0 .. L-2`` and position ``i`` attends to ``i + 1`` keys. Padding and
    masked-out keys an implementation computes anyway are not counted: they are not useful work."""
    h, hd = spec.hidden_size, spec.head_dim
    per_layer = 2 * h * (spec.num_heads + 2 * spec.num_kv_heads) * hd + 2 * spec.num_heads * hd * h + 2 * 3 * h * spec.intermediate_size
    key_visits = sum((n - 1) * n // 2 for n in seq_lens)
    attn = 4 * spec.num_heads * hd * key_visits * spec.num_layers
    return computed_tokens * spec.num_layers * per_layer + attn + sampled_tokens * 2 * h * spec.vocab_size


def capacity(wl: Workload, num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, int]:
    """Sequences of the workload resident at once: paged (blocks for their actual length) vs
    contiguous (a max_model_len reservation each)."""
    # A sequence of the workload's mix holds ceil(len / block_size) blocks on average when paged.
    mean_blocks = sum(-(-(len(p) + m) // block_size) for p, m in zip(wl.prompts, wl.outputs)) / len(wl.prompts)
    return int(num_blocks // mean_blocks), num_blocks * block_size // max_model_len


MACHINE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                 "amx_bf16", "amx_int8")  # the CPU flags that decide which fast paths exist


def machine_info() -> dict:
    """What the figures were measured on: CPU model, the flags that matter (fast paths: AVX-512,
    VNNI, AVX512-BF16, AMX), cores, torch / oneDNN versions and the load average at the start (the
    benchmark machine is shared: a load above the core count means the figures are low)."""
    import os
    import platform
    import re
    from pathlib import Path

    model, flags = platform.processor() or "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    dnn = re.search(r"MKL-DNN (v[\d.]+)|oneDNN (v[\d.]+)", torch.__config__.show())
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    affinity = getattr(os, "sched_getaffinity", None)
    return {"cpu_model": model, "cpu_flags": {f: f in flags for f in MACHINE_FLAGS} if flags else None,
            "cpu_count": os.cpu_count(), "usable_cores": len(affinity(0)) if affinity else os.cpu_count(),
            "torch": torch.__version__, "onednn": (dnn.group(1) or dnn.group(2)) if dnn else None,
            "loadavg_1_5_15_at_start": load}


def run(args: argparse.Namespace) -> int:
    from engine_workers.engine import torch_thread

    # Every engine (and the GEMM peak) on the process's one torch thread: the comparison is fair and
    # no engine pays for a second OpenMP pool (engine_workers/engine/torch_thread.py). transformers'
    # continuous batching still runs its generation on a thread of its own, as it does for its users.
    return torch_thread.call(_run, args)


def _run(args: argparse.Namespace) -> int:
    from engine_workers.engine.core import Engine
    from lockgate.options import engine_config_from_args

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    config = engine_config_from_args(args)
    machine = machine_info()  # before the engine loads: the load average is the other users'
    engine = Engine(config)
    spec = engine.loaded.spec
    wl = make_workload(spec.vocab_size, args.num_requests, args.seed)
    results: dict = {"machine": machine, "model": str(engine.loaded.path), "device": str(engine.device),
                     "dtype": str(engine.dtype), "weights": engine.weight_format, "quantization": config.quantization,
                     "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
                     "threads": torch.get_num_threads(), "requests": len(wl.prompts), "output_tokens": wl.output_tokens,
                     "prompt_tokens": sum(map(len, wl.prompts)), "repeat": args.repeat}
    hf = None if args.skip_hf else _hf_model(engine.loaded.path, engine.device, engine.dtype)
    warm = make_workload(spec.vocab_size, 4, args.seed + 1, (8, 32), (4, 8))
    run_lockgate(engine, warm)  # warm-ups: first calls of either engine pay one-time costs
    if hf is not None:
        run_hf_static(hf, warm)

    # Rounds of every measurement; each keeps its best (fastest run, highest GEMM rate), so on a
    # noisy machine no engine and not the peak is compared on a luckier draw than another.
    peaks: dict[str, float] = {}
    lockgate_runs: list[tuple[float, int]] = []
    hf_runs: dict[str, list[float]] = {"hf_static_b8": [], "hf_continuous": []}
    hf_errors: dict[str, str] = {}
    for _ in range(args.repeat):
        if engine.device.type == "cpu":
            for path, rate in measure_gemm_flops().items():
                peaks[path] = max(peaks.get(path, 0.0), rate)
        lockgate_runs.append(run_lockgate(engine, wl))
        if hf is not None:
            hf_runs["hf_static_b8"].append(run_hf_static(hf, wl))
            if "hf_continuous" not in hf_errors:
                try:
                    hf_runs["hf_continuous"].append(run_hf_continuous(hf, wl))
                except Exception as exc:  # report, do not hide: the comparison is then missing
                    log.exception("HF continuous batching failed")
                    hf_errors["hf_continuous"] = f"{type(exc).__name__}: {exc}"

    gemm = max(peaks.values()) if peaks else None
    results["gemm_flops"] = gemm
    results["gemm_flops_by_path"] = peaks or None
    elapsed, computed = min(lockgate_runs)
    flops = model_flops(spec, computed, wl.output_tokens, [len(p) + m for p, m in zip(wl.prompts, wl.outputs)])
    results["lockgate"] = {"seconds": elapsed, "tokens_per_s": wl.output_tokens / elapsed, "computed_tokens": computed,
                           "model_flops_per_s": flops / elapsed, "all_seconds": [t for t, _ in lockgate_runs]}
    if gemm:
        results["lockgate"]["roofline_share"] = flops / elapsed / gemm
        results["lockgate"]["roofline_share_by_path"] = {k: flops / elapsed / v for k, v in peaks.items()}
    paged, contiguous = capacity(wl, engine.kv.num_blocks, engine.kv.block_size, engine.max_model_len)
    results["capacity"] = {"kv_blocks": engine.kv.num_blocks, "block_size": engine.kv.block_size, "max_model_len": engine.max_model_len,
                           "paged_sequences": paged, "contiguous_sequences": contiguous,
                           "ratio": paged / contiguous if contiguous else float("inf")}
    if hf is not None:
        for key, runs in hf_runs.items():
            if key in hf_errors:
                results[key] = {"error": hf_errors[key]}
            else:
                results[key] = {"seconds": min(runs), "tokens_per_s": wl.output_tokens / min(runs), "all_seconds": runs}
                results[f"speedup_vs_{key}"] = results["lockgate"]["tokens_per_s"] / results[key]["tokens_per_s"]

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"workload: {results['requests']} requests, {results['prompt_tokens']} prompt + {results['output_tokens']} output tokens "
          f"(seed {args.seed}); {results['model']} on {results['device']} {results['dtype']} "
          f"(weights {results['weights']}, KV cache {results['kv_cache_dtype']}), {results['threads']} threads")
    m = machine
    have = ", ".join(f for f, on in (m["cpu_flags"] or {}).items() if on) or "unknown"
    lacks = ", ".join(f for f, on in (m["cpu_flags"] or {}).items() if not on)
    load = "/".join(f"{v:.2f}" for v in m["loadavg_1_5_15_at_start"]) if m["loadavg_1_5_15_at_start"] else "unknown"
    print(f"machine: {m['cpu_model']}, {m['usable_cores']} of {m['cpu_count']} cores; flags {have}"
          f"{'; lacks ' + lacks if lacks else ''}; torch {m['torch']}, oneDNN {m['onednn']}; "
          f"load average at start {load} (1/5/15 min)")
    if args.repeat > 1:
        print(f"{args.repeat} rounds; every engine and the GEMM peak keep their best")
    rows = [("lockgate", results["lockgate"])] + [(k, results[k]) for k in ("hf_static_b8", "hf_continuous") if k in results]
    print(f"{'engine':<16}{'seconds':>10}{'out tok/s':>12}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:<16}  failed: {r['error']}")
        else:
            print(f"{name:<16}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.1f}")
    for key in ("speedup_vs_hf_static_b8", "speedup_vs_hf_continuous"):
        if key in results:
            print(f"{key}: {results[key]:.2f}x")
    if gemm:
        by_path = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in results["gemm_flops_by_path"].items())
        print(f"fp32 GEMM peak (1024^3, this run, GFLOP/s): {by_path}; roofline = the faster, {gemm / 1e9:.1f}")
        shares = ", ".join(f"{v:.0%} of {k}" for k, v in results["lockgate"]["roofline_share_by_path"].items())
        print(f"lockgate executed {results['lockgate']['model_flops_per_s'] / 1e9:.1f} GFLOP/s of model FLOPs = "
              f"{results['lockgate']['roofline_share']:.0%} of roofline ({shares})")
    c = results["capacity"]
    print(f"KV capacity at {c['kv_blocks']} blocks x {c['block_size']}: paged {c['paged_sequences']} sequences vs contiguous "
          f"(max_model_len {c['max_model_len']}) {c['contiguous_sequences']} -> {c['ratio']:.1f}x")
    return 0

