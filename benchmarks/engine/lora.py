"""Throughput with LoRA adapters vs the base model (issue 53): the bench workload's requests run
to completion together, once on an engine without LoRA, then on one engine with ``--enable-lora``
with no request naming an adapter, every request naming one adapter, and the requests spread
round-robin over 4 (and 16) adapters. Generated tokens per second (best of ``--repeat``) and the
ratio to the base engine's, plus the time to load one adapter. Both engines stay loaded and every
repeat runs all the modes back to back (base first), so each ratio compares runs minutes apart
at most: on a shared machine only such ratios mean something, not the absolute rates.

    python -m benchmarks.engine.lora [--model M] [--requests 16] [--rank 16] [--adapters 1,4] [--repeat 2]

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


def run(model: str | None, requests: int, rank: int, adapter_counts: list[int], repeat: int, threads: int) -> list[dict[str, Any]]:
    from benchmarks.engine.workload import make_workload
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.model.lora.adapter import load_adapter
    from engine_workers.model.lora.layers import GROUPED_MAX_ROWS
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

    lora = Engine(replace(base_cfg, enable_lora=True, max_loras=most, max_lora_rank=rank,
                          lora_modules=tuple((f"a{i}", str(p)) for i, p in enumerate(paths))))
    assert lora.lora is not None
    # (engine, per-request adapters, count, grouped path on): several adapters also with the
    # segment path alone, the comparison the grouped path is for (engine_workers/model/lora/layers.py)
    modes = [(base, None, -1, True)] + [
        (lora, [f"a{i % n}" for i in range(requests)] if n else None, n, grouped)
        for n in [0, *adapter_counts] for grouped in ((True, False) if n > 1 else (True,))]
    best = [0.0] * len(modes)
    for r in range(repeat):
        for i, (engine, loras, _, grouped) in enumerate(modes):
            lora.lora.batch.grouped_max_rows = GROUPED_MAX_ROWS if grouped else 0
            best[i] = max(best[i], tok_s(engine, loras, r))
    rows: list[dict[str, Any]] = [{"mode": "base engine (no --enable-lora)", "adapters": 0, "tok_s": round(best[0], 1),
                                   "ratio": 1.0}]
    for (_, _, n, grouped), rate in zip(modes[1:], best[1:], strict=True):
        path = "" if n < 2 else (", grouped path on" if grouped else ", segment path only (the default)")
        rows.append({"mode": f"--enable-lora, {n} adapters over the requests{path}", "adapters": n, "rank": rank,
                     "tok_s": round(rate, 1), "ratio": round(rate / best[0], 3)})
    rows.append({"mode": "load one adapter (read + fuse)", "rank": rank, "seconds": round(load_s, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=16, help="requests of the bench workload (seed 0; default 16)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    p.add_argument("--adapters", default="1,4", help="adapter counts to spread the requests over (default 1,4)")
    p.add_argument("--repeat", type=int, default=2, help="runs per mode; the best counts (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.adapters.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        p.error("--adapters takes counts >= 1, e.g. 1,4,16")
    for row in run(args.model, args.requests, args.rank, counts, args.repeat, args.threads):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
