"""bf16 GEMMs on AMX tiles: the engine's tile kernel against oneDNN in 32-row pieces (the
batch-invariant oneDNN path) and oneDNN in one call (not batch-invariant above 32 rows), on this
machine (docs/benchmarks.md, "bf16 on AMX tiles (issue #49)").

    .venv/bin/python -m benchmarks.micro.amx_tiles [--rows 1 8 32 256 1024] [--threads 1] [--rounds 15]

SmolLM2-135M's linear shapes (N x K: 576x576, 1536x576, 576x1536, 192x576 and the 49152x576 LM head,
random weights), each at each row count M: ms per call, best of ``--rounds``, the three paths
alternating call by call so a shared machine's drift hits all of them. Every path takes float32
activations and returns float32 (the tile kernel's output unrounded; oneDNN's rounded to bf16 and
widened). The LM head runs only up to 256 rows (the engine computes logits for a step's last rows).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

SHAPES = ((576, 576), (1536, 576), (576, 1536), (192, 576), (49152, 576))
LM_HEAD_ROWS = 256


def _paths(n: int, k: int, gen: torch.Generator) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from engine_workers.kernels.amx_linear import AMX_ROWS, AmxLinear, TileOps, tiles

    ops: TileOps | None = tiles()
    if ops is None:
        raise SystemExit("the AMX tile kernel is not available here (needs the amx ISA level)")
    w = torch.randn(n, k, generator=gen) * 0.05
    tile_layer, onednn_layer = AmxLinear.build(w, None, ops), AmxLinear.build(w, None, None)
    one_call = onednn_layer._linear

    def one(x: torch.Tensor) -> torch.Tensor:
        return one_call(x.bfloat16(), onednn_layer.packed, None, "none", [], "").float()

    assert AMX_ROWS == 32  # the pieces below are the layer's own oneDNN path
    return {"tiles": tile_layer, "pieces": onednn_layer, "one call": one}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()

    from engine_workers.kernels import cpu_kernels

    if cpu_kernels.isa_level() != "amx":
        raise SystemExit(f"ISA level {cpu_kernels.isa_level()}: this benchmark needs the amx level")
    torch.set_num_threads(args.threads)
    from benchmarks.machine import describe, machine_info

    print(f"{describe(machine_info())}; threads {args.threads}")
    print("ms per call, best of", args.rounds)
    print(f"{'N x K':>10} {'M':>5} {'tiles':>8} {'pieces':>8} {'one call':>8}  pieces/tiles  one/tiles")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        paths = _paths(n, k, gen)
        for m in args.rows:
            if n == 49152 and m > LM_HEAD_ROWS:
                continue
            x = torch.randn(m, k, generator=gen)
            best = {name: float("inf") for name in paths}
            for fn in paths.values():
                fn(x)
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    t = time.perf_counter()
                    fn(x)
                    best[name] = min(best[name], time.perf_counter() - t)
            t, pc, one = (best[name] * 1e3 for name in ("tiles", "pieces", "one call"))
            print(f"{n:>5}x{k:<4} {m:>5} {t:8.3f} {pc:8.3f} {one:8.3f}  {pc / t:12.2f}  {one / t:9.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
