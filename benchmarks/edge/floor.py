"""The kernel's floor under ``lockgate bench edge``: what one small write to each of N loopback TCP
sockets costs, with no edge, no bus and no Python beyond a ``send`` loop.

Why: every token an edge fans out is one ``write`` to one client socket. On loopback the sender's
``write`` also runs the receiving side's TCP processing and wakes the reader, so it costs several
µs of the sender's CPU whatever the edge does around it. A step of S streams is S such writes back
to back, so ``S x floor`` is the least time one edge process can take to deliver a step: the
latency its last token waits even if the edge's own code cost nothing. ``bench edge`` measures it
in the same run (same machine state) and reports the edge's CPU per token against it.

Set-up: this process listens and accepts N connections from a spawned reader process, which drains
them with ``selectors``. Then ``rounds`` times: one ``send`` of ``payload`` bytes (a WebSocket text
frame of a delta's size) to every socket, timed with ``time.process_time``, then a pause (as between
engine steps) so the reader keeps up and no socket buffer fills. Sockets are ``TCP_NODELAY``, as
asyncio and uvloop set them.
"""

from __future__ import annotations

import multiprocessing as mp
import selectors
import socket
import time

ROUND_PAUSE_S = 0.02  # between rounds, as between engine steps


def _reader(port: int, n: int, total_bytes: int, ready) -> None:
    sel = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, s)
            socks.append(s)
        ready.set()
        got, deadline = 0, time.monotonic() + 120
        while got < total_bytes and time.monotonic() < deadline:
            for key, _ in sel.select(1.0):
                data = key.data.recv(1 << 16)
                if not data:
                    return
                got += len(data)
    finally:
        for s in socks:
            s.close()


def send_floor_us(n_sockets: int, rounds: int = 20, payload: int = 60) -> float:
    """CPU µs this process spends per ``send`` of ``payload`` bytes to one of ``n_sockets``
    loopback TCP sockets (mean over ``rounds`` rounds of one send per socket). Blocking; spawns and
    joins one reader process; ``ValueError`` for arguments out of range."""
    if n_sockets < 1 or rounds < 1 or not 2 <= payload <= 125:
        raise ValueError("n_sockets and rounds must be >= 1, payload 2..125 bytes")
    frame = bytes((0x81, payload - 2)) + b"x" * (payload - 2)  # an unmasked text frame
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    conns: list[socket.socket] = []
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(min(n_sockets, 4096))
        proc = ctx.Process(target=_reader, args=(ls.getsockname()[1], n_sockets, n_sockets * rounds * payload, ready),
                           daemon=True)
        proc.start()
        try:
            ls.settimeout(30)
            for _ in range(n_sockets):
                c, _ = ls.accept()
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.setblocking(False)
                conns.append(c)
            if not ready.wait(30):
                raise RuntimeError("floor reader did not connect")
            cpu = 0.0
            for _ in range(rounds):
                c0 = time.process_time()
                for c in conns:
                    c.send(frame)
                cpu += time.process_time() - c0
                time.sleep(ROUND_PAUSE_S)
        finally:
            for c in conns:
                c.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return cpu / (n_sockets * rounds) * 1e6
