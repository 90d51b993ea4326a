"""Per-layer times of the Q4_1 block kernel, its dequantize + GEMM path and the float32 paths, by
row count, on SmolLM2-135M's layer shapes (random weights): where the block kernel stops paying
(``BLOCK_KERNEL_MAX_ROWS`` in engine_workers/kernels/cpu_blocks.py; docs/benchmarks.md, "4-bit weights").

    .venv/bin/python -m benchmarks.micro.block_linear [--rows 1 4 16 32 64 128 512] [--repeat 5]

Per shape and row count: best-of-``--repeat`` mean over a timed loop of the whole layer set
(qkv, o, gate_up, down, and the Q8_0 head at the row counts a head sees). The machine may be
shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def _time(fn, loops: int, repeat: int) -> float:
    best = float("inf")
    fn()
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 512])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    from benchmarks.engine.bench import machine_info
    from engine_workers.kernels import cpu_kernels
    from engine_workers.kernels.cpu_blocks import BlockLinear, block_ops
    from engine_workers.kernels.cpu_linear import PackedLinear

    print(machine_info(), flush=True)
    ops, small = block_ops(), cpu_kernels.small_m()
    assert ops is not None, "block kernel unavailable"
    gen = torch.Generator().manual_seed(0)
    layers = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        layers[name] = (BlockLinear.quantized("q8_0" if name == "head" else "q4_1", w),
                        PackedLinear.from_weight(w, small_m=small))
    print(f"{'rows':>5} {'layer':>8} {'kernel ms':>10} {'deq+GEMM ms':>12} {'fp32 ms':>9}")
    for m in args.rows:
        for name, (blk, f32) in layers.items():
            if name == "head" and m > 64:
                continue
            x = torch.randn(m, blk.in_features, generator=gen)
            loops = max(1, int(2e8 // (m * blk.in_features * blk.out_features + 1e7)))
            kern = _time(lambda x=x, blk=blk: blk(x), loops, args.repeat)
            gemm = _time(lambda x=x, blk=blk: torch.mm(x, blk.dequantized().t()), loops, args.repeat)
            ref = _time(lambda x=x, f32=f32: f32(x), loops, args.repeat)
            print(f"{m:>5} {name:>8} {kern:>10.3f} {gemm:>12.3f} {ref:>9.3f}", flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
