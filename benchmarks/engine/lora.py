"""Throughput with LoRA adapters vs the base model (issue 53): the bench workload's requests run
to completion together, once on an engine without LoRA, then on one engine with ``--enable-lora``
with no request naming an adapter, every request naming one adapter, and the requests spread
round-robin over 4 (and 16) adapters (``--fp32-adapters``: those modes again on an engine whose
adapters stay float32 beside the same base, ``LOCKGATE_LORA_TILES=0``). Generated tokens per
second, the median of ``--repeat`` runs, and the ratio to the base engine's median, plus the time
to load one adapter. The engines stay loaded, are warmed up once, and every repeat runs all the
modes back to back, each repeat starting one mode later (so no mode is always first): on a shared
machine only such ratios mean something, not the absolute rates.

    python -m benchmarks.engine.lora [--model M] [--requests 16] [--rank 16] [--adapters 1,4] [--repeat 3]

The adapters are synthetic PEFT folders (random A and B, every target lockgate adapts, rank
``--rank``): throughput does not depend on the values. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, spec, rank: int, seed: int) -> Path:
    """A PEFT-format adapter for ``spec`` (a ModelSpec): every target of every layer, random weights."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, kv, h, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for i in range(spec.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return folder


def run(model: str | None, requests: int, rank: int, adapter_counts: list[int], repeat: int, threads: int,
        fp32_adapters: bool = False) -> list[dict[str, Any]]:
    import os
    import statistics

    from benchmarks.engine.workload import make_workload
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.model.lora.adapter import load_adapter
    from engine_workers.model.lora.layers import TILES_ENV
    from lockgate_types import SamplingParams

    base_cfg = EngineConfig(model=model, max_num_seqs=requests, num_threads=threads or None)
    base = Engine(base_cfg)
    wl = make_workload(base.loaded.spec.vocab_size, requests, seed=0, prompt_range=(8, 128), output_range=(16, 64))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.outputs]
    most = max(adapter_counts)
    tmp = Path(tempfile.mkdtemp(prefix="lockgate-lora-bench-"))
    paths = [write_adapter(tmp / f"a{i}", base.loaded.spec, rank, i) for i in range(most)]
    t0 = time.perf_counter()
    load_adapter("a0", paths[0], base.loaded.spec, base.dtype, rank)
    load_s = time.perf_counter() - t0

    def tok_s(engine: Engine, loras, r: int) -> float:
        t = time.perf_counter()
        done = engine.generate(wl.prompts, params, cache_salt=f"r{r}-{time.monotonic_ns()}", loras=loras)
        return sum(len(d.token_ids) for d in done) / (time.perf_counter() - t)

    lora_cfg = replace(base_cfg, enable_lora=True, max_loras=most, max_lora_rank=rank,
                       lora_modules=tuple((f"a{i}", str(p)) for i, p in enumerate(paths)))
    engines = [("", Engine(lora_cfg))]
    if fp32_adapters:  # the same engine with float32 adapters (segments) beside the same base: A/B
        old = os.environ.get(TILES_ENV)
        os.environ[TILES_ENV] = "0"
        try:
            engines.append((", float32 adapters (segments)", Engine(lora_cfg)))
        finally:
            if old is None:
                del os.environ[TILES_ENV]
            else:
                os.environ[TILES_ENV] = old
    # (label, engine, per-request adapters, adapter count)
    modes: list[tuple[str, Engine, list[str] | None, int]] = [("base engine (no --enable-lora)", base, None, -1)]
    for suffix, engine in engines:
        assert engine.lora is not None
        path = next(iter(engine.lora.layers.values())).tiles is not None
        how = "bf16 adapters on AMX tiles (stacked)" if path else "float32 adapters"
        for n in [0, *adapter_counts]:
            if n == 0 and suffix:
                continue
            loras = [f"a{i % n}" for i in range(requests)] if n else None
            modes.append((f"--enable-lora, {n} adapters over the requests{suffix} [{how}]", engine, loras, n))
    for _, engine, loras, _ in modes:  # warm up: kernel checks, every slot's install, the first stacks
        engine.generate(wl.prompts, [replace(p, max_tokens=2) for p in params], cache_salt=f"warm-{time.monotonic_ns()}",
                        loras=loras)
    rates: list[list[float]] = [[] for _ in modes]
    for r in range(repeat):  # each repeat runs every mode, starting one mode later than the last
        for k in range(len(modes)):
            i = (k + r) % len(modes)
            rates[i].append(tok_s(modes[i][1], modes[i][2], r))
    med = [statistics.median(x) for x in rates]
    rows: list[dict[str, Any]] = []
    for (label, _, _, n), rate, runs in zip(modes, med, rates, strict=True):
        row: dict[str, Any] = {"mode": label, "adapters": max(n, 0), "tok_s": round(rate, 1), "ratio": round(rate / med[0], 3),
                               "runs": [round(v, 1) for v in runs]}
        if n >= 0:
            row["rank"] = rank
        rows.append(row)
    rows.append({"mode": "load one adapter (read + fuse)", "rank": rank, "seconds": round(load_s, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=16, help="requests of the bench workload (seed 0; default 16)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    p.add_argument("--adapters", default="1,4", help="adapter counts to spread the requests over (default 1,4)")
    p.add_argument("--repeat", type=int, default=3, help="runs per mode; the median counts (default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--fp32-adapters", action="store_true",
                   help="also run the adapter modes with float32 adapters beside the same base (LOCKGATE_LORA_TILES=0)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.adapters.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        p.error("--adapters takes counts >= 1, e.g. 1,4,16")
    for row in run(args.model, args.requests, args.rank, counts, args.repeat, args.threads, args.fp32_adapters):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
