"""Batch invariance of the CPU linears (issue #38; docs/benchmarks-robustness.md).

    .venv/bin/python -m benchmarks.micro.batch_invariance cost
    .venv/bin/python -m benchmarks.micro.batch_invariance streams [--model DIR] [--streams 16] [--tokens 48]

``cost``: one SmolLM2-135M layer's linears (qkv, o, gate_up, down) at M = 64 and 512 rows, on
oneDNN (what rows above SMALL_M_MAX used before) and on the small-batch kernel in 32-row pieces
(what every row uses now); best of 10.
``streams``: the same seeded temperature-0.8 requests once all in one batch and once each alone;
prints how many streams differ (0 when a row's logits do not depend on the batch).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable


def _best_ms(f: Callable[[], object], n: int = 10) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def cost() -> None:
    import torch

    from engine_workers.kernels import cpu_kernels
    from engine_workers.kernels.cpu_linear import PackedLinear

    small_m = cpu_kernels.small_m()
    if small_m is None:
        raise SystemExit(f"no small-batch kernel here: {cpu_kernels.small_m_problem()}")
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    for rows in (64, 512):
        old = new = 0.0
        for n, k in shapes.values():
            lin = PackedLinear.from_weight(torch.randn(n, k, generator=gen), None, small_m)
            x = torch.randn(rows, k, generator=gen)
            old += _best_ms(functools.partial(lin._linear, x, lin.packed, None, "none", [], ""))
            new += _best_ms(functools.partial(lin, x))
        print(f"M={rows}: one layer's linears, oneDNN {old:.2f} ms, small-batch kernel in 32-row pieces "
              f"{new:.2f} ms ({new / old:.2f}x)")


def streams(model: str, count: int, max_tokens: int) -> None:
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    engine = Engine(EngineConfig(model=model, kv_cache_bytes=256 << 20, max_num_seqs=32))

    def drain() -> dict[str, list[int]]:
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        return outs

    prompts = [f"Write a short story about a character number {i} who" for i in range(count)]
    params = [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True) for i in range(count)]
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params[i])
    batched = drain()
    differ = 0
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params[i])
        differ += drain()[f"a{i}"] != batched[f"b{i}"]
    print(f"{differ} of {count} sampled streams differ between one batch and alone")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("what", choices=("cost", "streams"))
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/lockgate/models/smollm2-135m-instruct"))
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    if a.what == "cost":
        cost()
    else:
        streams(a.model, a.streams, a.tokens)


if __name__ == "__main__":
    main()
