"""``lockgate bench decode``: the paged decode attention kernel on batches shaped like serving steps.

Three peers on the same inputs, in one process, alternated round by round (each keeps its best):
- **split**: the kernel as the engine calls it (``cpu_kernels.paged_decode``: on AVX-512 builds and
  head sizes 32/64/128 the split-K, register-tiled path);
- **loop**: the same kernel's one-task-per-sequence loop (``cpu_kernels.paged_decode_loop``; the
  path of other builds, and the whole kernel before the split path);
- **sdpa**: gather + SDPA (``cpu_kernels.reference_decode``), the engine's path with the kernels off.

A "step" calls the attention once per layer, each layer with its own K/V cache, so K/V comes from
wherever a real decode step finds it (the whole step's K/V is larger than the L2 caches, often
than L3), and blocks are scattered through the cache as a long-running engine leaves them. Times
are per layer; GB/s counts the K and V bytes of every context token once.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# (name, context lengths): decode batches of a serving mix (many mid-length, one skewed, few long, one)
CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("10 x 600", (600,) * 10),
    ("10 of 100-1100", (1100, 1000, 900, 800, 700, 500, 400, 300, 200, 100)),
    ("16 x 300", (300,) * 16),
    ("4 x 1000", (1000,) * 4),
    ("1 x 1024", (1024,)),
)


@dataclass(frozen=True, slots=True)
class Shape:
    heads: int = 9  # SmolLM2-135M: 9 query heads over 3 KV heads of 64
    kv_heads: int = 3
    head_size: int = 64
    layers: int = 30
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    kv_dtype: str
    tokens: int
    ms_per_layer: dict[str, float]  # peer -> best ms per layer
    gb_per_s: dict[str, float]


def _layer(lens: tuple[int, ...], shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    import torch

    bs = shape.block_size
    need = [-(-n // bs) for n in lens]
    blocks = sum(need) + 8
    order = torch.randperm(blocks, generator=gen)  # scattered blocks, as a long-running cache leaves them
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used: used + n]
        used += n
    k = torch.randn(blocks * bs, shape.kv_heads, shape.head_size, generator=gen).to(dtype)
    v = torch.randn(blocks * bs, shape.kv_heads, shape.head_size, generator=gen).to(dtype)
    q = torch.randn(len(lens), shape.heads, shape.head_size, generator=gen)
    return q, k, v, tables, torch.tensor(lens), bs, shape.head_size**-0.5


def _labelled(where: str) -> Callable[[str], str]:
    """An ``assert_close`` message that says which peer and input failed."""
    return lambda m: f"{where}: {m}"


def _step_time(fn: Callable, layers: list[tuple], steps: int) -> float:
    fn(*layers[0])
    t = time.perf_counter()
    for _ in range(steps):
        for args in layers:
            fn(*args)
    return (time.perf_counter() - t) / (steps * len(layers))


def measure(peers: dict[str, Callable], shape: Shape, cases=CASES, kv_dtypes=("float32", "bfloat16"),
            rounds: int = 3, steps: int = 5, seed: int = 0) -> list[Row]:
    """Per case and K/V dtype, every peer's best ms per layer (after checking each against the
    "sdpa" peer, when there is one)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name, lens in cases:
        for dtype in (getattr(torch, d) for d in kv_dtypes):
            layers = [_layer(lens, shape, dtype, gen) for _ in range(shape.layers)]
            if "sdpa" in peers:  # timing a wrong kernel is no result
                want = peers["sdpa"](*layers[0])
                for p, fn in peers.items():
                    torch.testing.assert_close(fn(*layers[0]), want, rtol=1e-4, atol=1e-5,
                                               msg=_labelled(f"{p} on {name}, {dtype}"))
            best = {p: float("inf") for p in peers}
            for _ in range(rounds):
                for p, fn in peers.items():
                    best[p] = min(best[p], _step_time(fn, layers, steps))
            nbytes = sum(lens) * 2 * shape.kv_heads * shape.head_size * (4 if dtype == torch.float32 else 2)
            rows.append(Row(name, str(dtype).removeprefix("torch."), sum(lens),
                            {p: s * 1e3 for p, s in best.items()}, {p: nbytes / s / 1e9 for p, s in best.items()}))
    return rows


def format_table(rows: list[Row], peers: list[str]) -> str:
    head = "| batch (context lengths) | K/V | " + " | ".join(f"{p} ms/layer" for p in peers) + " | split GB/s | "
    head += " | ".join(f"{p} / split" for p in peers if p != "split") + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(peers) - 1)]
    for r in rows:
        ms = r.ms_per_layer
        cells = [f"{ms[p]:.3f}" for p in peers] + [f"{r.gb_per_s['split']:.1f}"]
        cells += [f"{ms[p] / ms['split']:.2f}x" for p in peers if p != "split"]
        lines.append(f"| {r.case} | {r.kv_dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.machine import describe, machine_info
    from engine_workers.kernels import cpu_kernels

    split, loop = cpu_kernels.paged_decode(), cpu_kernels.paged_decode_loop()
    if split is None or loop is None:
        print(f"no CPU decode kernel here: {cpu_kernels.problem()}")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    peers: dict[str, Callable] = {"split": split, "loop": loop}
    if not args.no_sdpa:
        peers["sdpa"] = cpu_kernels.reference_decode
    shape = Shape(args.heads, args.kv_heads, args.head_size, args.layers, args.block_size)
    machine = machine_info()
    rows = measure(peers, shape, rounds=args.rounds, steps=args.steps)
    if args.json:
        print(json.dumps({"machine": machine, "shape": asdict(shape), "threads": torch.get_num_threads(),
                          "rows": [asdict(r) for r in rows]}))
        return 0
    print(describe(machine))
    print(f"shape {asdict(shape)}, {torch.get_num_threads()} threads, best of {args.rounds} rounds of {args.steps} steps")
    print(format_table(rows, list(peers)))
    return 0


def add_args(b: argparse.ArgumentParser) -> None:
    d = Shape()
    b.add_argument("--heads", type=int, default=d.heads, help="query heads (default: SmolLM2-135M's 9)")
    b.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads (default 3)")
    b.add_argument("--head-size", type=int, default=d.head_size, help="head size (default 64)")
    b.add_argument("--layers", type=int, default=d.layers,
                   help="layers per step, each with its own K/V cache (default 30)")
    b.add_argument("--block-size", type=int, default=d.block_size, help="KV block size (default 16)")
    b.add_argument("--rounds", type=int, default=3, help="rounds; each peer keeps its best (default 3)")
    b.add_argument("--steps", type=int, default=5, help="steps per round and peer (default 5)")
    b.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    b.add_argument("--no-sdpa", action="store_true", help="leave out the gather + SDPA peer")
    b.add_argument("--json", action="store_true", help="print one JSON object")
