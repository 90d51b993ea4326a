"""Decode steps at long context with a float32 and a bf16 KV cache, one process (docs/benchmarks.md,
"KV cache in bf16").

    .venv/bin/python -m benchmarks.micro.kv_dtype [--shapes 16x2048 1x4096] [--steps 5 --rounds 3] [--no-cpu-kernels]

Two engines on the default model (``--kv-cache-dtype float32`` and ``bfloat16``, the same
everything else) take turns: per round and shape ``BxL``, each runs ``--steps`` decode steps of B
sequences at context L through the model runner. The caches hold random K/V instead of a real
prefill (a prefill of 16 x 2k tokens would take minutes here; a decode step's cost does not depend
on the values it reads). Printed: ms per step (best and median over all steps of all rounds), the
decode attention kernel's share (the kernel alone over every layer's cache, best wall-clock and
best CPU time of all threads, the steadier of the two on a shared machine), and the load average,
because the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["16x2048", "1x4096"], help="BxL: B sequences at context L")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cpu-kernels", action="store_true")
    args = p.parse_args()

    from engine_workers.engine import torch_thread

    torch_thread.call(_run, args)


def _shape(text: str) -> tuple[int, int]:
    b, _, ln = text.lower().partition("x")
    return int(b), int(ln)


def _run(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig

    from benchmarks.engine.bench import machine_info
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.model.execution.batch import Chunk, ModelInput
    from engine_workers.model.execution.runner import ModelRunner, kv_block_bytes
    from engine_workers.model.models.llama import ModelSpec
    from tokenization.model_store import ensure_default_model

    shapes = [_shape(s) for s in args.shapes]
    bs = EngineConfig().block_size
    blocks = max(b * -(-(ln + 1) // bs) for b, ln in shapes)  # the tables below use blocks [0, blocks)
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(ensure_default_model()))
    print(machine_info(), flush=True)
    engines = {}
    for kv, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        need = blocks * kv_block_bytes(spec, bs, dtype)
        engines[kv] = Engine(EngineConfig(kv_cache_bytes=need, kv_cache_dtype=kv, cpu_kernels=not args.no_cpu_kernels))
        assert engines[kv].kv.num_blocks == blocks
    gen = torch.Generator().manual_seed(0)
    for engine in engines.values():
        for k, v in engine.runner.kv_caches:
            k.copy_(torch.randn(k.shape, generator=gen) * 0.5)
            v.copy_(torch.randn(v.shape, generator=gen) * 0.5)
    times: dict[tuple[str, tuple[int, int]], list[float]] = {}
    attn: dict[tuple[str, tuple[int, int]], list[float]] = {}
    attn_cpu: dict[tuple[str, tuple[int, int]], list[float]] = {}  # CPU time, all threads: steadier under load
    for rnd in range(args.rounds):
        for shape in shapes:
            b, ln = shape
            for name, engine in engines.items():
                nblk = -(-(ln + 1) // bs)
                tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
                step = ModelInput(tuple(Chunk([100 + i], ln, tables[i], True) for i in range(b)))
                engine.runner.execute(step)  # warm: first call of a shape
                for _ in range(args.steps):
                    start = time.perf_counter()
                    engine.runner.execute(step)
                    times.setdefault((name, shape), []).append((time.perf_counter() - start) * 1e3)
                assert isinstance(engine.runner, ModelRunner), "one process: no --tensor-parallel-size here"
                fn = engine.runner.decode_kernel
                if fn is not None:  # the kernel alone over every layer's cache, as a step reads them
                    spec = engine.loaded.spec
                    q = torch.randn(b, spec.num_heads, spec.head_dim, generator=gen)
                    tab, ctx = torch.tensor(tables), torch.full((b,), ln + 1)
                    for _ in range(args.steps):
                        start, cpu = time.perf_counter(), time.process_time()
                        for kc, vc in engine.runner.kv_caches:
                            fn(q, kc, vc, tab, ctx, bs, 0.125)
                        attn.setdefault((name, shape), []).append((time.perf_counter() - start) * 1e3)
                        attn_cpu.setdefault((name, shape), []).append((time.process_time() - cpu) * 1e3)
        print(f"round {rnd}: load {os.getloadavg()}", flush=True)
    print(f"{'shape':>10}{'KV':>10}{'best ms/step':>14}{'median':>10}{'attn ms (best)':>16}{'attn CPU ms':>13}")
    for shape in shapes:
        for name in engines:
            t = times[(name, shape)]
            a, c = attn.get((name, shape)), attn_cpu.get((name, shape))
            print(f"{shape[0]:>4}x{shape[1]:<5}{name:>10}{min(t):>14.1f}{statistics.median(t):>10.1f}"
                  f"{min(a) if a else float('nan'):>16.1f}{min(c) if c else float('nan'):>13.1f}")


if __name__ == "__main__":
    main()
