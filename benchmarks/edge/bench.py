"""``lockgate bench edge``: how many connections one edge holds, how many tokens/s it fans out, and
the latency it adds between a worker publishing a token and a client receiving it.

Set-up: this process runs the edge (uvloop when installed), a memory bus and a :class:`FakeWorker`
whose token text is its publish time (``"<unix time>;"``). Client processes (``--client-procs``)
open ``--connections`` WebSockets and hold them; then ``--streams`` of them each ask for
``--tokens`` tokens at once. The fake worker emits one token per stream every ``--step-ms``
(the offered load is ``streams / step`` tokens/s). Each client parses the stamps out of the text it
receives, so latency = client receive time - worker publish time (same machine, same clock). The
fake worker shares the edge's process and core: its cost is included in the edge's figures.

``--edge-procs N`` runs N such edges (this process and N-1 spawned ones), each with its own memory
bus and fake worker, all listening on one port with SO_REUSEPORT (``lockgate edge --reuse-port``):
the kernel spreads the connections, each edge streams the requests of its own connections. The
CPU and GC figures are summed (maximum for the longest pause) over the edge processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time

from benchmarks.edge.floor import send_floor_us
from benchmarks.edge.load import GcPauses, client_proc
from bus import TopicLayout
from lockgate.runtime import freeze_heap, raise_nofile, run_loop

MODEL = "bench"


def _stamp(_prompt_ids: tuple[int, ...], _i: int) -> str:  # FakeWorker's token_text callback
    return f"{time.time():.6f};"


WINDOW_S = 0.5
WINDOW_MIN = 1000  # latencies a window needs for its p99 to count (the last one is usually short)


def window_p99s(published: list[float], latencies: list[float], window_s: float = WINDOW_S,
                min_n: int = WINDOW_MIN) -> list[float]:
    """The p99 latency of each ``window_s`` of publish time, in time order; windows with fewer than
    ``min_n`` latencies are left out."""
    if len(published) != len(latencies):
        raise ValueError(f"{len(published)} publish stamps for {len(latencies)} latencies")
    if not published:
        return []
    t0 = min(published)
    by: dict[int, list[float]] = {}
    for p, x in zip(published, latencies):
        by.setdefault(int((p - t0) / window_s), []).append(x)
    return [_pct(xs, 99) for _, xs in sorted(by.items()) if len(xs) >= min_n]


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class _Shard:
    """One edge with its own memory bus and fake worker (``--edge-procs`` runs one per process,
    all listening on one port with SO_REUSEPORT; the kernel spreads the connections)."""

    def __init__(self, port: int, step_ms: float, reuse_port: bool, workers: int = 1) -> None:
        self.port, self.step_ms, self.reuse_port, self.workers = port, step_ms, reuse_port, workers

    async def start(self) -> int:
        import bus as busmod
        from devtools.fake_worker import FakeWorker
        from devtools.tiny_model import build_tokenizer
        from edge.config import EdgeConfig
        from edge.request import PromptEncoder
        from edge.server import Edge

        tok = await asyncio.to_thread(build_tokenizer)
        self.bus = busmod.connect("memory://")
        await self.bus.start()
        cfg = EdgeConfig(model=MODEL, port=self.port, keys=None, slo_wait_s=(1e9, 1e9, 1e9), slo_ttft_ms=(1e12,) * 3,
                         ping_interval_s=None,
                         send_queue_frames=4096, max_streams_per_connection=4, max_connections=10**6,
                         reuse_port=self.reuse_port)
        step = self.step_ms / 1000
        # One worker: it steps as soon as work arrives (every token of a step in one burst). A
        # fleet: worker k steps on the grid k * step / N of the monotonic clock, as workers whose
        # steps nobody synchronises; the same phases in every edge process.
        self.fws = [FakeWorker(self.bus, MODEL, worker_id=f"fake-{k}", step_s=step, token_text=_stamp,
                               step_phase_s=None if self.workers == 1 else k * step / self.workers)
                    for k in range(self.workers)]
        self.edge = Edge(cfg, self.bus, PromptEncoder(tok, 1 << 20))
        try:
            for fw in self.fws:
                await fw.start()
            await self.edge.start()
        except BaseException:
            for fw in self.fws:
                await fw.stop()
            await self.bus.stop()
            raise
        freeze_heap()  # as `lockgate edge` does once started
        return self.edge.port

    async def stop(self) -> None:
        await self.edge.stop()
        for fw in self.fws:
            await fw.stop()
        await self.bus.stop()


def _edge_proc(pipe, port: int, step_ms: float, workers: int) -> None:
    """An extra edge shard: ("ready") -> "held?" -> ("held", n) -> "go" ... "stop" -> ("stats", ...)."""
    raise_nofile()

    async def main() -> None:
        shard = _Shard(port, step_ms, reuse_port=True, workers=workers)
        await shard.start()
        try:
            pipe.send(("ready",))
            assert await asyncio.to_thread(pipe.recv) == "held?"
            pipe.send(("held", len(shard.edge.sessions)))
            assert await asyncio.to_thread(pipe.recv) == "go"
            cpu0 = time.process_time()
            with GcPauses() as pauses:
                assert await asyncio.to_thread(pipe.recv) == "stop"
            pipe.send(("stats", len(shard.edge.sessions), time.process_time() - cpu0, pauses.pauses))
        finally:
            await shard.stop()

    run_loop(main())


async def _bench(args: argparse.Namespace) -> dict:
    nofile = raise_nofile()
    if args.edge_procs < 1 or args.client_procs < 1 or args.workers < 1:
        raise ValueError("--edge-procs, --client-procs and --workers must be >= 1")
    if args.workers > TopicLayout().partitions:
        raise ValueError(f"--workers must be <= {TopicLayout().partitions} (the request topic's partitions: "
                         f"a worker beyond that gets no partition), got {args.workers}")
    shard = _Shard(0, args.step_ms, reuse_port=args.edge_procs > 1, workers=args.workers)
    port = await shard.start()
    ctx = mp.get_context("spawn")
    procs, pipes, edge_pipes = [], [], []
    per = args.connections // args.client_procs
    streams_per = args.streams // args.client_procs
    try:
        for _ in range(args.edge_procs - 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_edge_proc, args=(child, port, args.step_ms, args.workers), daemon=True)
            p.start()
            procs.append(p)
            edge_pipes.append(parent)
        for ep in edge_pipes:
            await asyncio.to_thread(ep.recv)  # ("ready",): listening on the shared port
        for _ in range(args.client_procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_proc, daemon=True,
                            args=(child, port, per, list(range(streams_per)), args.tokens, args.client))
            p.start()
            procs.append(p)
            pipes.append(parent)
        held = [await asyncio.to_thread(pp.recv) for pp in pipes]
        connect_s = max(h[3] for h in held)
        for ep in edge_pipes:
            ep.send("held?")
        per_edge_held = [len(shard.edge.sessions)] + [(await asyncio.to_thread(ep.recv))[1] for ep in edge_pipes]
        for pp in edge_pipes + pipes:
            pp.send("go")
        t0, cpu0 = time.time(), time.process_time()
        with GcPauses() as gc_pauses:
            results = [(await asyncio.to_thread(pp.recv))[1] for pp in pipes]
        wall, edge_cpu = time.time() - t0, time.process_time() - cpu0
        pauses = list(gc_pauses.pauses)
        held_after = len(shard.edge.sessions)
        for ep in edge_pipes:
            ep.send("stop")
        for ep in edge_pipes:
            _, n, cpu, ps = await asyncio.to_thread(ep.recv)
            held_after += n
            edge_cpu += cpu
            pauses += ps
        for pp in pipes:
            pp.send("close")
        for p in procs:
            await asyncio.to_thread(p.join, 30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        await shard.stop()
    lat = [x for r in results for x in r["latencies"]]
    windows = window_p99s([p for r in results for p in r["published"]], lat)
    tokens = sum(r["tokens"] for r in results)
    first = min(r["first"] for r in results if r["first"])
    last = max(r["last"] for r in results if r["last"])
    return {
        "connections_requested": args.connections,
        "connections_held": sum(per_edge_held),
        "connections_per_edge": per_edge_held,
        "connections_held_after_streaming": held_after,
        "connect_failures": sum(h[2] for h in held),
        "connect_seconds": round(connect_s, 2),
        "streams": streams_per * args.client_procs,
        "tokens_per_stream": args.tokens,
        "offered_tokens_per_s": round(streams_per * args.client_procs / (args.step_ms / 1000)),
        "tokens_received": tokens,
        "tokens_expected": streams_per * args.client_procs * args.tokens,
        "tokens_per_s": round(tokens / max(1e-9, last - first)),
        "stream_phase_seconds": round(wall, 2),
        "latency_ms_p50": round(_pct(lat, 50) * 1000, 2),
        "latency_ms_p90": round(_pct(lat, 90) * 1000, 2),
        "latency_ms_p99": round(_pct(lat, 99) * 1000, 2),
        "latency_ms_max": round(max(lat) * 1000, 2) if lat else None,
        # p99 of each WINDOW_S of publish time: a stall of the machine shows as a few bad windows,
        # a burst the edge cannot absorb as every window bad. The median is a typical window's.
        "latency_ms_p99_windows": [round(w * 1000, 1) for w in windows],
        "latency_ms_p99_window_median": round(statistics.median(windows) * 1000, 2) if windows else None,
        # CPU seconds used during the streaming phase: the edge processes (edge + bus + fake
        # worker) and all client processes together; per token, the cost of one fanned-out token.
        "edge_process_cpu_s": round(edge_cpu, 2),
        "clients_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
        "edge_process_cpu_us_per_token": round(edge_cpu / max(1, tokens) * 1e6, 1),
        # Share of the machine's CPU time those processes used while streaming: near 1 the cores
        # are saturated (by the edge and the load generator together) and latency is queueing.
        # Per edge process, the share of one core it used: an event loop is one thread, so near 1
        # it is saturated and every token queues behind the rest of its step.
        "edge_core_busy_share": round(edge_cpu / max(1e-9, wall * args.edge_procs), 2),
        "cpu_busy_share": round((edge_cpu + sum(r["cpu_s"] for r in results)) / max(1e-9, wall * (os.cpu_count() or 1)), 2),
        # Garbage-collector pauses in the edge's process during the streaming phase (each one
        # stops every connection; a full collection's cost grows with the objects alive).
        "edge_gc_collections": len(pauses),
        "edge_gc_pause_ms_max": round(max((p for _, p in pauses), default=0.0) * 1000, 1),
        "edge_gc_pause_ms_total": round(sum(p for _, p in pauses) * 1000, 1),
        "edge_gc_full_collections": sum(1 for g, _ in pauses if g == 2),
        # The load generator's own pauses: a client paused by its collector reads late, and that
        # wait is counted as the edge's latency.
        "clients_gc_collections": sum(len(r["gc_pauses"]) for r in results),
        "clients_gc_pause_ms_max": round(max((p for r in results for _, p in r["gc_pauses"]), default=0.0) * 1000, 1),
        "edge_procs": args.edge_procs,
        "workers_per_edge": args.workers,
        "client_procs": args.client_procs,
        "client": args.client,
        "cpus": os.cpu_count(),
        "nofile": nofile,
    }


def run_bench(args: argparse.Namespace) -> int:
    out: dict = {}

    async def main() -> None:
        out.update(await _bench(args))

    run_loop(main())
    if args.floor:
        # Same machine state, after the edge is gone: the kernel's part of one token's delivery.
        floor = send_floor_us(max(1, out["streams"]))
        per_edge = out["streams"] / out["edge_procs"]
        out["kernel_send_floor_us"] = round(floor, 2)
        out["edge_cpu_over_floor"] = round(out["edge_process_cpu_us_per_token"] / floor, 2)
        # The least time one edge process needs to write one step's tokens (its share of the
        # streams, one send each) even if its own code cost nothing: its last token waits that long.
        out["step_write_floor_ms"] = round(per_edge * floor / 1000, 2)
    for k, v in out.items():
        print(f"{k:36s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
