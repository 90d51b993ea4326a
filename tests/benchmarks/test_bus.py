"""`lockgate bench bus` (benchmarks/bus.py) on the memory bus: every record is received, the figures are
ordered, and the run leaves no topic behind."""

from __future__ import annotations

import os

import pytest

from benchmarks.bus import bench_one, format_table, local_broker_pids, process_cpu_s
from bus import forget_named, named_broker


async def test_bench_bus_receives_everything_and_deletes_its_topic() -> None:
    name = "bench-bus-test"
    try:
        r = await bench_one(f"memory://{name}", rate=400, seconds=0.5, partitions=3, payload=64, warmup_s=0.1)
        assert r.sent == r.received == 200
        assert 0 <= r.p50_ms <= r.p99_ms <= r.p999_ms <= r.max_ms
        assert r.records_per_s > 0
        assert r.client_cpu_us_per_record is not None and r.client_cpu_us_per_record > 0
        assert r.broker_cpu_us_per_record is None and r.broker_idle_cpu_pct is None  # no broker process
        assert named_broker(name).topics == {}, "the run's topic is deleted when it ends"
        assert "memory://bench-bus-test" in format_table([r])
    finally:
        forget_named(name)


async def test_bench_bus_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--rate"):
        await bench_one("memory://", rate=0, seconds=1)


def test_local_broker_pids_only_for_a_loopback_kafka_url() -> None:
    assert local_broker_pids("memory://") is None
    assert local_broker_pids("kafka://kafka.example.com:9092") is None  # remote: not ours to read
    assert local_broker_pids("kafka://127.0.0.1:1") is None  # no `lockgate kafka start` cluster there
    assert process_cpu_s([os.getpid()]) > 0
    assert process_cpu_s([2**22 + 1]) is None  # beyond pid_max: cannot be read


@pytest.mark.kafka
async def test_bench_bus_on_kafka_counts_client_and_broker_cpu(kafka_bootstrap: str) -> None:
    url = f"kafka://{kafka_bootstrap}"
    r = await bench_one(url, rate=200, seconds=1.0, partitions=2, payload=64, warmup_s=0.2)
    assert r.sent == r.received == 200
    assert r.client_cpu_us_per_record is not None and r.client_cpu_us_per_record > 0
    if local_broker_pids(url) is None:  # a broker this process cannot see (LOCKGATE_TEST_KAFKA elsewhere)
        assert r.broker_cpu_us_per_record is None
    else:
        assert r.broker_cpu_us_per_record is not None and r.broker_cpu_us_per_record >= 0
        assert r.broker_idle_cpu_pct is not None and r.broker_idle_cpu_pct >= 0
        assert "broker us/rec" in format_table([r])
