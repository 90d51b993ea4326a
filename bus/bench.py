"""``lockgate bench bus``: produce→consume latency and throughput, memory bus vs a Kafka bus, one run.

Method (the same for every bus): a fresh topic with ``partitions`` partitions; a group-less consumer
reading from "latest"; a producer that *schedules* ``rate`` records/s for ``seconds`` (open loop:
record ``i`` is due at ``t0 + i/rate``; sends run as concurrent tasks, at most ``max_in_flight``),
keyed by a rotating request id. Each value carries ``perf_counter_ns`` taken just before ``send``;
latency = receive time − that stamp, so it covers batching (linger), the broker round trip with
``acks=all``, and the consumer's fetch. Throughput = records received / (last − first receive).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
from dataclasses import asdict, dataclass

from bus import TopicSpec, connect

_STAMP = struct.Struct(">qQ")  # send perf_counter_ns, sequence number


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

    def as_dict(self) -> dict:
        return asdict(self)


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
    async with connect(url) as bus:
        await bus.ensure_topics([TopicSpec(topic, partitions)])
        async with bus.consumer([topic], start_from="latest") as consumer:
            done = asyncio.Event()

            async def consume() -> None:
                seen = 0
                while seen < warm + total:
                    for rec in await consumer.getmany(timeout_ms=200):
                        now = time.perf_counter_ns()
                        sent_ns, seq = _STAMP.unpack_from(rec.value)
                        seen += 1
                        if seq >= warm:
                            latencies.append((now - sent_ns) / 1e6)
                            recv_times.append(now)
                done.set()

            slots = asyncio.Semaphore(max_in_flight)
            tasks: set[asyncio.Task] = set()

            async def send(seq: int) -> None:
                try:
                    value = _STAMP.pack(time.perf_counter_ns(), seq) + pad
                    await bus.send(topic, value, key=f"req-{seq % 1000}".encode())
                finally:
                    slots.release()

            consumer_task = asyncio.create_task(consume())
            t0 = time.perf_counter()
            try:
                for seq in range(warm + total):
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
    return BusBenchResult(
        bus=url, rate=rate, seconds=seconds, sent=total, received=len(latencies),
        p50_ms=_pct(latencies, 0.50), p99_ms=_pct(latencies, 0.99), p999_ms=_pct(latencies, 0.999),
        max_ms=latencies[-1] if latencies else float("nan"),
        records_per_s=len(recv_times) / span if span and span == span else float("nan"),
    )


def format_table(results: list[BusBenchResult]) -> str:
    head = f"{'bus':<34} {'rate/s':>7} {'sent':>7} {'recv':>7} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'max ms':>8} {'rec/s':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.bus:<34} {r.rate:>7} {r.sent:>7} {r.received:>7} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} "
                     f"{r.p999_ms:>9.3f} {r.max_ms:>8.3f} {r.records_per_s:>9.1f}")
    if len(results) >= 2:
        base, other = results[0], results[1]
        lines.append("")
        lines.append(f"ratios {other.bus} / {base.bus}: p50 x{other.p50_ms / base.p50_ms:.1f}, "
                     f"p99 x{other.p99_ms / base.p99_ms:.1f}")
    return "\n".join(lines)
