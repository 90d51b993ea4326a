"""Small-batch linear kernel vs oneDNN's packed GEMM, on this machine (docs/benchmarks.md).

    .venv/bin/python -m benchmarks.micro.small_m [--rows 1 4 8 16 24 32 48] [--steps 5 --rounds 6]

1. Layer shapes: SmolLM2's 30 QKV, O, gate/up and down weights plus the LM head (random values,
   same shapes), all of them once per round, at each row count M: ms per full pass, both paths,
   best of ``--rounds``.
2. Engine decode steps: the default model at batches 8, 16 and 32 (prompts of 100-200 tokens,
   greedy), the same engine with the kernel's panels switched on and off between rounds of
   ``--steps`` steps (alternating, so the machine's drift hits both): best and median ms per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _best(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def layer_shapes(rows: list[int], rounds: int) -> None:
    from engine_workers.kernels import cpu_kernels
    from engine_workers.kernels.cpu_linear import PackedLinear

    small_m = cpu_kernels.small_m()
    if small_m is None:
        raise SystemExit(f"no small-batch kernel here: {cpu_kernels.small_m_problem()}")
    h, inter, vocab, layers = 576, 1536, 49152, 30
    gen = torch.Generator().manual_seed(0)
    lins = [PackedLinear.from_weight(torch.randn(n, k, generator=gen) * 0.05, small_m=small_m)
            for (k, n, reps) in ((h, 960, layers), (h, h, layers), (h, 2 * inter, layers), (inter, h, layers),
                                 (h, vocab, 1)) for _ in range(reps)]
    panels = [lin.panels for lin in lins]
    print(f"{len(lins)} weights, {sum(p.numel() for p in panels if p is not None) * 4 / 2**20:.0f} MiB; ms per pass (best of {rounds})")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in (h, inter)}

        def run(on: bool, xs: dict[int, torch.Tensor] = xs) -> None:  # binds this M's inputs
            for lin, p in zip(lins, panels):
                lin.panels = p if on else None
                lin(xs[lin.in_features])

        k, o = _best(lambda: run(True), rounds), _best(lambda: run(False), rounds)
        print(f"  M={m:3d}: kernel {k:6.2f}  oneDNN {o:6.2f}  oneDNN/kernel {o / k:.2f}")
    for lin, p in zip(lins, panels):
        lin.panels = p


def decode_steps(batches: list[int], steps: int, rounds: int) -> None:
    from benchmarks.engine.bench import make_workload
    from engine_workers.engine import torch_thread
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.kernels.cpu_linear import PackedLinear
    from lockgate_types import SamplingParams

    def main() -> None:
        eng = Engine(EngineConfig(kv_cache_bytes=512 << 20))
        lins = [m for m in eng.runner.model.modules() if isinstance(m, PackedLinear)]
        saved = [(lin, lin.panels) for lin in lins]
        if not any(p is not None for _, p in saved):
            raise SystemExit("the engine did not enable the small-batch kernel (see its log)")
        print(f"decode steps, default model, ms per step ({rounds} alternating rounds of {steps} steps)")
        for b in batches:
            wl = make_workload(eng.loaded.spec.vocab_size, b, 5, (100, 200), (8, 9))
            sp = SamplingParams(temperature=0.0, max_tokens=steps * rounds * 2 + 50, ignore_eos=True)
            ids = [f"b{b}-{i}" for i in range(b)]
            for rid, prompt in zip(ids, wl.prompts):
                eng.add_request(rid, prompt, sp, cache_salt=f"bench-small-m-{b}")
            for _ in range(12):  # prefill done, steady decode
                eng._step()
            res: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(rounds):
                for on in (True, False):
                    for lin, p in saved:
                        lin.panels = p if on else None
                    t = time.perf_counter()
                    for _ in range(steps):
                        eng._step()
                    res[on].append((time.perf_counter() - t) / steps * 1e3)
            k, o = res[True], res[False]
            print(f"  batch {b:2d}: kernel {min(k):5.1f} (median {statistics.median(k):5.1f})  "
                  f"oneDNN {min(o):5.1f} (median {statistics.median(o):5.1f})")
            for rid in ids:
                eng.abort(rid)
            eng._step()
        for lin, p in saved:
            lin.panels = p

    torch_thread.call(main)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    layer_shapes(a.rows, a.rounds)
    decode_steps(a.batches, a.steps, a.rounds)
