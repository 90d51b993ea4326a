"""`lockgate bench bus` (bus/bench.py) on the memory bus: every record is received, the figures are
ordered, and the run leaves no topic behind."""

from __future__ import annotations

import pytest

from bus import forget_named, named_broker
from bus.bench import bench_one, format_table


async def test_bench_bus_receives_everything_and_deletes_its_topic() -> None:
    name = "bench-bus-test"
    try:
        r = await bench_one(f"memory://{name}", rate=400, seconds=0.5, partitions=3, payload=64, warmup_s=0.1)
        assert r.sent == r.received == 200
        assert 0 <= r.p50_ms <= r.p99_ms <= r.p999_ms <= r.max_ms
        assert r.records_per_s > 0
        assert named_broker(name).topics == {}, "the run's topic is deleted when it ends"
        assert "memory://bench-bus-test" in format_table([r])
    finally:
        forget_named(name)


async def test_bench_bus_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--rate"):
        await bench_one("memory://", rate=0, seconds=1)
