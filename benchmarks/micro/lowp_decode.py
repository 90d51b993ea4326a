"""Decode steps with fp32, bf16, int8 and 4-bit (Q4_1) linear weights, one process
(docs/benchmarks.md, "Low-precision weights", "4-bit weights").

    .venv/bin/python -m benchmarks.micro.lowp_decode [--batches 1 8 32] [--tokens 64 --rounds 3]
        [--engines fp32 bf16 int8 q4_1]

Engines on the default model (``--dtype auto``, ``--dtype bfloat16``, ``--quantization int8``,
``--quantization q4_1``) take turns: per round and batch size, each generates ``--tokens`` greedy tokens for ``batch``
8-token prompts (fresh prefix-cache salt). Printed: ms per step (the 8-token prefill amortised in),
best over rounds; with ``--per-step``, each decode step is timed alone (the prefill step left out)
and the minimum and median over all rounds are printed, which a shared machine's preemptions
disturb less. The load average is printed too.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

ENGINES = {"fp32": ("auto", "none"), "bf16": ("bfloat16", "none"), "int8": ("auto", "int8"), "q4_1": ("auto", "q4_1")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-step", action="store_true", help="time each decode step alone: min and median")
    p.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(ENGINES))
    args = p.parse_args()

    from engine_workers.engine import torch_thread

    torch_thread.call(_run, args)


def _run(args: argparse.Namespace) -> None:
    from benchmarks.engine.bench import machine_info
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    print(machine_info(), flush=True)
    engines = {name: Engine(EngineConfig(kv_cache_bytes=256 << 20, dtype=ENGINES[name][0], quantization=ENGINES[name][1]))
               for name in args.engines}
    best: dict[tuple[str, int], float] = {}
    steps: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for batch in args.batches:
            for name, engine in engines.items():
                prompts = [[100 + i, 200, 300, 400, 500, 600, 700, 800] for i in range(batch)]
                params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
                salt = uuid.uuid4().hex
                if args.per_step:
                    for i, prompt in enumerate(prompts):
                        engine.add_request(f"bench-{rnd}-{i}", prompt, params, cache_salt=salt)
                    engine.step()  # the prefill
                    while engine.has_unfinished():
                        start = time.perf_counter()
                        engine.step()
                        steps.setdefault((name, batch), []).append((time.perf_counter() - start) * 1e3)
                    continue
                start = time.perf_counter()
                engine.generate(prompts, [params] * batch, cache_salt=salt)
                ms = (time.perf_counter() - start) / args.tokens * 1e3
                best[(name, batch)] = min(best.get((name, batch), float("inf")), ms)
        print(f"round {rnd}: load {os.getloadavg()}", flush=True)
    if args.per_step:
        print(f"{'batch':>6}" + "".join(f"{n + ' min/median ms':>24}" for n in engines))
        for batch in args.batches:
            cells = [sorted(steps[(n, batch)]) for n in engines]
            print(f"{batch:>6}" + "".join(f"{c[0]:>12.1f} /{c[len(c) // 2]:>9.1f}" for c in cells))
        return
    print(f"{'batch':>6}" + "".join(f"{n + ' ms/step':>16}" for n in engines))
    for batch in args.batches:
        print(f"{batch:>6}" + "".join(f"{best[(n, batch)]:>16.1f}" for n in engines))


if __name__ == "__main__":
    main()
