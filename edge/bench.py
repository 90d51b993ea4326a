"""``lockgate bench edge``: how many connections one edge holds, how many tokens/s it fans out, and
the latency it adds between a worker publishing a token and a client receiving it.

Set-up: this process runs the edge (uvloop when installed), a memory bus and a :class:`FakeWorker`
whose token text is its publish time (``"<unix time>;"``). Client processes (``--client-procs``)
open ``--connections`` WebSockets and hold them; then ``--streams`` of them each ask for
``--tokens`` tokens at once. The fake worker emits one token per stream every ``--step-ms``
(the offered load is ``streams / step`` tokens/s). Each client parses the stamps out of the text it
receives, so latency = client receive time - worker publish time (same machine, same clock). The
fake worker shares the edge's process and core: its cost is included in the edge's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time

from edge.commands import raise_nofile, run_loop

MODEL = "bench"


def _stamp(prompt_ids: tuple[int, ...], i: int) -> str:
    return f"{time.time():.6f};"


def _client_proc(pipe, port: int, n_conns: int, stream_idx: list[int], tokens: int) -> None:  # noqa: ANN001
    raise_nofile()
    run_loop(_clients(pipe, port, n_conns, stream_idx, tokens))


async def _clients(pipe, port: int, n_conns: int, stream_idx: list[int], tokens: int) -> None:  # noqa: ANN001
    import orjson
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{port}/ws"
    sem = asyncio.Semaphore(200)
    conns: list = []
    failed = 0

    async def open_one() -> None:
        nonlocal failed
        async with sem:
            try:
                conns.append(await connect(url, ping_interval=None, open_timeout=60, compression=None,
                                           max_queue=64))
            except Exception:
                failed += 1

    t0 = time.time()
    await asyncio.gather(*(open_one() for _ in range(n_conns)))
    pipe.send(("held", len(conns), failed, time.time() - t0))
    await asyncio.to_thread(pipe.recv)  # "go"

    lat: list[float] = []
    received = 0
    first = last = None

    async def stream(i: int, ws) -> None:  # noqa: ANN001
        nonlocal received, first, last
        await ws.send(orjson.dumps({"type": "generate", "id": f"b{i}", "prompt": f"bench {i}",
                                    "max_tokens": tokens}).decode())
        while True:
            f = orjson.loads(await ws.recv())
            now = time.time()
            if f["type"] == "delta":
                stamps = f["text"].split(";")[:-1]
                received += len(stamps)
                lat.extend(now - float(s) for s in stamps)
                first = now if first is None else min(first, now)
                last = now if last is None else max(last, now)
            elif f["type"] in ("done", "error"):
                return

    await asyncio.gather(*(stream(i, conns[i]) for i in stream_idx if i < len(conns)))
    still_open = sum(1 for c in conns if c.state.name == "OPEN")
    pipe.send(("result", {"latencies": lat, "tokens": received, "first": first, "last": last,
                          "still_open": still_open}))
    await asyncio.to_thread(pipe.recv)  # "close"
    await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def _bench(args: argparse.Namespace) -> dict:
    import bus as busmod
    from edge.config import EdgeConfig
    from edge.fake_worker import FakeWorker
    from edge.protocol import PromptEncoder
    from edge.server import Edge
    from engine_workers.tiny_model import build_tokenizer

    nofile = raise_nofile()
    tok = await asyncio.to_thread(build_tokenizer)
    encoder = PromptEncoder(tok, 1 << 20)
    b = busmod.connect("memory://")
    await b.start()
    cfg = EdgeConfig(model=MODEL, port=0, keys=None, slo_wait_s=(1e9, 1e9, 1e9), ping_interval_s=None,
                     send_queue_frames=4096, max_streams_per_connection=4, max_connections=10**6)
    fw = FakeWorker(b, MODEL, step_s=args.step_ms / 1000, token_text=_stamp)
    await fw.start()
    edge = Edge(cfg, b, encoder)
    await edge.start()
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    per = args.connections // args.client_procs
    streams_per = args.streams // args.client_procs
    try:
        for k in range(args.client_procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_proc, args=(child, edge.port, per, list(range(streams_per)), args.tokens),
                            daemon=True)
            p.start()
            procs.append(p)
            pipes.append(parent)
        held = [await asyncio.to_thread(pp.recv) for pp in pipes]
        connect_s = max(h[3] for h in held)
        server_held = len(edge.sessions)
        for pp in pipes:
            pp.send("go")
        t0 = time.time()
        results = [(await asyncio.to_thread(pp.recv))[1] for pp in pipes]
        wall = time.time() - t0
        held_after = len(edge.sessions)
        for pp in pipes:
            pp.send("close")
        for p in procs:
            await asyncio.to_thread(p.join, 30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        await edge.stop()
        await fw.stop()
        await b.stop()
    lat = [x for r in results for x in r["latencies"]]
    tokens = sum(r["tokens"] for r in results)
    first = min(r["first"] for r in results if r["first"])
    last = max(r["last"] for r in results if r["last"])
    return {
        "connections_requested": args.connections,
        "connections_held": server_held,
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
        "client_procs": args.client_procs,
        "cpus": os.cpu_count(),
        "nofile": nofile,
    }


def run_bench(args: argparse.Namespace) -> int:
    out: dict = {}

    async def main() -> None:
        out.update(await _bench(args))

    run_loop(main())
    for k, v in out.items():
        print(f"{k:36s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
