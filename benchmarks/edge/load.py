"""The client side of ``lockgate bench edge``: processes that open and hold WebSocket connections,
start the streams together, and tally per-token latency from the stamps the fake worker puts in
each token's text (``"<unix time>;"``). Two clients: a lean frame parser
(:mod:`benchmarks.edge.client`) and the websockets library's, which costs more CPU per frame.
"""

from __future__ import annotations

import asyncio
import gc
import time

from lockgate.runtime import raise_nofile, run_loop


def client_proc(pipe, port: int, n_conns: int, stream_idx: list[int], tokens: int, kind: str) -> None:
    raise_nofile()
    run_loop((_raw_clients if kind == "raw" else _clients)(pipe, port, n_conns, stream_idx, tokens))


def _generate_frame(i: int, tokens: int) -> bytes:
    """Stream ``i``'s request: both load generators send exactly this."""
    import orjson

    return orjson.dumps({"type": "generate", "id": f"b{i}", "prompt": f"bench {i}", "max_tokens": tokens})


class _Tally:
    """What one client process received: latencies (receive - publish stamp), tokens, span."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.published: list[float] = []  # the worker's stamp of each latency, in the same order
        self.received = 0
        self.first: float | None = None
        self.last: float | None = None

    def delta(self, text: str, now: float) -> None:
        stamps = text.split(";")[:-1]
        self.received += len(stamps)
        pub = [float(s) for s in stamps]
        self.published.extend(pub)
        self.lat.extend(now - p for p in pub)
        if self.first is None:
            self.first = now
        self.last = now

    def result(self, still_open: int, cpu: float, gc_pauses: list[tuple[int, float]]) -> tuple:
        return ("result", {"latencies": self.lat, "published": self.published, "tokens": self.received,
                           "first": self.first, "last": self.last, "still_open": still_open, "cpu_s": cpu,
                           "gc_pauses": gc_pauses})


async def _raw_clients(pipe, port: int, n_conns: int, stream_idx: list[int], tokens: int) -> None:
    """The lean client (benchmarks/edge/client.py): frames are handled inside ``data_received``."""
    import orjson

    from benchmarks.edge.client import connect_raw

    sem = asyncio.Semaphore(200)
    conns: dict = {}
    failed = 0
    tally = _Tally()
    pending: set[int] = set()
    all_done = asyncio.Event()

    def finished(i: int) -> None:
        pending.discard(i)
        if not pending:
            all_done.set()

    def handler(i: int):
        def on_text(payload: bytes) -> None:
            now = time.time()
            f = orjson.loads(payload)
            kind = f["type"]
            if kind == "delta":
                tally.delta(f["text"], now)
            elif kind in ("done", "error"):
                finished(i)
        return on_text

    async def open_one(i: int) -> None:
        nonlocal failed
        async with sem:
            try:
                c = conns[i] = await connect_raw("127.0.0.1", port, "/ws", handler(i))
                c.closed.add_done_callback(lambda _: finished(i))  # a dropped stream ends too
            except Exception:
                failed += 1

    t0 = time.time()
    await asyncio.gather(*(open_one(i) for i in range(n_conns)))
    pipe.send(("held", len(conns), failed, time.time() - t0))
    await asyncio.to_thread(pipe.recv)  # "go"
    cpu0 = time.process_time()
    with GcPauses() as pauses:
        pending.update(i for i in stream_idx if i in conns)
        for i in sorted(pending):
            conns[i].send_text(_generate_frame(i, tokens))
        if pending:
            # Bounded: a stream that never ends shows up as missing tokens, not as a hung benchmark.
            waiter = asyncio.ensure_future(all_done.wait())
            await asyncio.wait({waiter}, timeout=60 + tokens)
            waiter.cancel()
    cpu = time.process_time() - cpu0
    pipe.send(tally.result(sum(1 for c in conns.values() if c.open), cpu, pauses.pauses))
    await asyncio.to_thread(pipe.recv)  # "close"
    for c in conns.values():
        c.close()
    if conns:
        await asyncio.wait([c.closed for c in conns.values()], timeout=30)


async def _clients(pipe, port: int, n_conns: int, stream_idx: list[int], tokens: int) -> None:
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

    tally = _Tally()

    async def stream(i: int, ws) -> None:
        await ws.send(_generate_frame(i, tokens).decode())
        while True:
            f = orjson.loads(await ws.recv())
            if f["type"] == "delta":
                tally.delta(f["text"], time.time())
            elif f["type"] in ("done", "error"):
                return

    cpu0 = time.process_time()
    with GcPauses() as pauses:
        await asyncio.gather(*(stream(i, conns[i]) for i in stream_idx if i < len(conns)))
    cpu = time.process_time() - cpu0
    pipe.send(tally.result(sum(1 for c in conns if c.state.name == "OPEN"), cpu, pauses.pauses))
    await asyncio.to_thread(pipe.recv)  # "close"
    await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


class GcPauses:
    """Records (generation, seconds) of every garbage collection while the block runs."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)
