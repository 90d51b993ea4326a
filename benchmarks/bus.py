"""``lockgate bench bus``: produce→consume latency and throughput, memory bus vs a Kafka bus, one run.

Method (the same for every bus): a fresh topic with ``partitions`` partitions; a group-less consumer
reading from "latest"; a producer that *schedules* ``rate`` records/s for ``seconds`` (open loop:
record ``i`` is due at ``t0 + i/rate``; sends run as concurrent tasks, at most ``max_in_flight``),
keyed by a rotating request id. Each value carries ``perf_counter_ns`` taken just before ``send``;
latency = receive time − that stamp, so it covers batching (linger), the broker round trip with
``acks=all``, and the consumer's fetch. Throughput = records received / (last − first receive).

CPU per record, over the measured records (warm-up excluded): ``client`` is this process's event
loop thread (producer, consumer and the loop together: ``time.thread_time``); ``broker`` is the
local broker's process (``lockgate kafka start`` on the URL's loopback port, read from ``/proc``),
net of its idle rate measured for ``IDLE_S`` just before. ``None`` where it cannot be read: a
remote broker, no ``/proc``, or the memory bus (whose "broker" is the client's own loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
import uuid
from dataclasses import asdict, dataclass

from bus import TopicSpec, connect

_STAMP = struct.Struct(">qQ")  # send perf_counter_ns, sequence number
IDLE_S = 1.0  # the broker's idle CPU rate is measured this long before the first record
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True, slots=True)
class _Mark:
    """One reading of the clocks CPU per record is computed from."""

    t: float  # perf_counter
    loop_cpu_s: float  # this thread's CPU
    broker_cpu_s: float | None  # the local broker's CPU; None when not readable


@dataclass(frozen=True, slots=True)
class BusBenchResult:
    bus: str
    rate: int
    seconds: float
    sent: int
    received: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    records_per_s: float
    client_cpu_us_per_record: float | None = None
    broker_cpu_us_per_record: float | None = None  # net of the broker's idle rate
    broker_idle_cpu_pct: float | None = None  # of one core

    def as_dict(self) -> dict:
        return asdict(self)


def local_broker_pids(url: str) -> list[int] | None:
    """Pids of the ``lockgate kafka start`` cluster (1 or 3 nodes, numbered from the URL's first
    port) behind a loopback ``kafka://`` URL, or ``None`` when the URL is not one (remote, memory,
    nothing of ours running there)."""
    if not url.startswith("kafka://"):
        return None
    from bus import kafka_bootstrap
    from devtools import kafka_local

    try:
        hosts = kafka_bootstrap(url)
    except ValueError:
        return None
    if any(host.strip("[]") not in _LOOPBACK for host, _ in hosts):
        return None
    for nodes in (1, 3):  # the cluster sizes `lockgate kafka start` makes
        try:
            pids = [p for p in kafka_local.status(nodes=nodes, port=hosts[0][1]).pids if p is not None]
        except ValueError:  # a port that command never uses
            return None
        if pids:
            return pids
    return None


def process_cpu_s(pids: list[int]) -> float | None:
    """User + system CPU seconds of ``pids`` (all their threads), or ``None`` when one cannot be read."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _pct(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


async def bench_one(url: str, rate: int, seconds: float, partitions: int = 6, payload: int = 200,
                    max_in_flight: int = 10_000, warmup_s: float = 0.5) -> BusBenchResult:
    """Measure one bus; see the module docstring. ``warmup_s`` of records are sent and discarded."""
    if rate < 1 or seconds <= 0:
        raise ValueError(f"--rate must be >= 1 and --seconds > 0, got {rate} and {seconds}")
    topic = f"lockgate.bench.{uuid.uuid4().hex[:10]}"
    pad = b"x" * max(payload - _STAMP.size, 0)
    total = int(rate * seconds)
    warm = int(rate * warmup_s)
    latencies: list[float] = []
    recv_times: list[int] = []
    pids = local_broker_pids(url)

    def mark() -> _Mark:
        return _Mark(time.perf_counter(), time.thread_time(), process_cpu_s(pids) if pids else None)

    start: _Mark | None = None  # at the first measured send
    end: _Mark | None = None  # at the last receive
    idle_rate: float | None = None  # broker CPU seconds per second before the first record
    async with connect(url) as bus:
        await bus.ensure_topics([TopicSpec(topic, partitions)])
        async with bus.consumer([topic], start_from="latest") as consumer:
            done = asyncio.Event()

            async def consume() -> None:
                nonlocal end
                seen = 0
                while seen < warm + total:
                    for rec in await consumer.getmany(timeout_ms=200):
                        now = time.perf_counter_ns()
                        sent_ns, seq = _STAMP.unpack_from(rec.value)
                        seen += 1
                        if seq >= warm:
                            latencies.append((now - sent_ns) / 1e6)
                            recv_times.append(now)
                end = mark()
                done.set()

            slots = asyncio.Semaphore(max_in_flight)
            tasks: set[asyncio.Task] = set()

            async def send(seq: int) -> None:
                try:
                    value = _STAMP.pack(time.perf_counter_ns(), seq) + pad
                    await bus.send(topic, value, key=f"req-{seq % 1000}".encode())
                finally:
                    slots.release()

            if pids:  # the broker's idle rate, with this consumer already connected and polling
                a = mark()
                await asyncio.sleep(IDLE_S)
                b = mark()
                if a.broker_cpu_s is not None and b.broker_cpu_s is not None:
                    idle_rate = (b.broker_cpu_s - a.broker_cpu_s) / (b.t - a.t)
            consumer_task = asyncio.create_task(consume())
            t0 = time.perf_counter()
            try:
                for seq in range(warm + total):
                    if seq == warm:
                        start = mark()
                    delay = t0 + seq / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await slots.acquire()
                    task = asyncio.create_task(send(seq))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 30)
            finally:
                consumer_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consumer_task
        await bus.delete_topics([topic])  # this run's own topic: leave nothing behind on the broker
    latencies.sort()
    span = (recv_times[-1] - recv_times[0]) / 1e9 if len(recv_times) > 1 else float("nan")
    n = len(latencies)
    client_us = broker_us = idle_pct = None
    if n and start is not None and end is not None:
        client_us = (end.loop_cpu_s - start.loop_cpu_s) / n * 1e6
        if idle_rate is not None and start.broker_cpu_s is not None and end.broker_cpu_s is not None:
            broker_us = max(0.0, end.broker_cpu_s - start.broker_cpu_s - idle_rate * (end.t - start.t)) / n * 1e6
            idle_pct = idle_rate * 100
    return BusBenchResult(
        bus=url, rate=rate, seconds=seconds, sent=total, received=len(latencies),
        p50_ms=_pct(latencies, 0.50), p99_ms=_pct(latencies, 0.99), p999_ms=_pct(latencies, 0.999),
        max_ms=latencies[-1] if latencies else float("nan"),
        records_per_s=len(recv_times) / span if span and span == span else float("nan"),
        client_cpu_us_per_record=client_us, broker_cpu_us_per_record=broker_us, broker_idle_cpu_pct=idle_pct,
    )


def format_table(results: list[BusBenchResult]) -> str:
    head = (f"{'bus':<34} {'rate/s':>7} {'sent':>7} {'recv':>7} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} "
            f"{'max ms':>8} {'rec/s':>9} {'client us/rec':>13} {'broker us/rec':>13}")
    lines = [head, "-" * len(head)]

    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in results:
        lines.append(f"{r.bus:<34} {r.rate:>7} {r.sent:>7} {r.received:>7} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} "
                     f"{r.p999_ms:>9.3f} {r.max_ms:>8.3f} {r.records_per_s:>9.1f} {us(r.client_cpu_us_per_record):>13} "
                     f"{us(r.broker_cpu_us_per_record):>13}")
    if len(results) >= 2:
        base, other = results[0], results[1]
        lines.append("")
        lines.append(f"ratios {other.bus} / {base.bus}: p50 x{other.p50_ms / base.p50_ms:.1f}, "
                     f"p99 x{other.p99_ms / base.p99_ms:.1f}")
    if any(r.broker_idle_cpu_pct is not None for r in results):
        idle = ", ".join(f"{r.broker_idle_cpu_pct:.1f} %" for r in results if r.broker_idle_cpu_pct is not None)
        lines.append(f"CPU per measured record: client = this process's event loop thread (producer + consumer); "
                     f"broker = the local broker process net of its idle rate ({idle} of a core)")
    return "\n".join(lines)
