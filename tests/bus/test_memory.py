"""What only the memory bus has: bounded retention, named brokers, URL options, its exact contracts."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bus import (
    BusError,
    MemoryBus,
    TopicPartition,
    TopicSpec,
    UnknownTopicError,
    connect,
    forget_named,
)
from bus.partitioner import partition_for_key
from tests.waiting import suspended, wait_until


async def test_partition_count_bound_drops_oldest_and_readers_skip_ahead() -> None:
    async with connect("memory://?max_records_per_partition=3") as bus:
        for i in range(5):
            meta = await bus.send("t", str(i).encode())
            assert meta.offset == i
        async with bus.consumer(["t"], start_from="earliest") as c:
            recs = await c.getmany(timeout_ms=10)
        assert [(r.offset, r.value) for r in recs] == [(2, b"2"), (3, b"3"), (4, b"4")]


async def test_offsets_stay_exact_across_head_compaction() -> None:
    # 5,000 records through a 1,500-record bound: the dead head is deleted several times (at
    # >= 1,024 dead records); every read after that must still map offsets to the right records.
    async with connect("memory://?max_records_per_partition=1500") as bus:
        async with bus.consumer(["t"], start_from="latest") as tail:
            await tail.getmany(timeout_ms=1)
            seen: list[int] = []
            for i in range(5000):
                await bus.send("t", str(i).encode())
                if i % 700 == 0:
                    seen += [int(r.value) for r in await tail.getmany(timeout_ms=1, max_records=10_000)]
            seen += [int(r.value) for r in await tail.getmany(timeout_ms=1, max_records=10_000)]
        assert seen == list(range(5000))  # the live reader kept up: nothing skipped or repeated
        part = bus.broker.topics["t"].partitions[0]
        assert (part.start, part.end, len(part)) == (3500, 5000, 1500)
        assert len(part.values) < 2 * 1500 + 1024  # dead prefix really freed
        async with bus.consumer(["t"], start_from="earliest") as c:
            recs = await c.getmany(timeout_ms=10, max_records=10_000)
        assert [(r.offset, int(r.value)) for r in recs] == [(o, o) for o in range(3500, 5000)]
        first_ts = recs[0].timestamp_ms
        assert part.offset_for_time(first_ts) == 3500 and part.offset_for_time(first_ts + 10**6) == 5000


async def test_retention_by_age() -> None:
    async with connect("memory://") as bus:
        await bus.ensure_topics([TopicSpec("t", 1, retention_ms=30)])
        await bus.send("t", b"old")
        await asyncio.sleep(0.06)  # not synchronisation: "old" must age past its 30 ms retention
        await bus.send("t", b"new")
        async with bus.consumer(["t"], start_from="earliest") as c:
            assert [r.value for r in await c.getmany(timeout_ms=10)] == [b"new"]


async def test_named_broker_is_shared_between_buses() -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    try:
        async with connect(f"memory://{name}") as producer, connect(f"memory://{name}") as worker:
            async with worker.consumer(["t"], group_id="g", start_from="earliest") as c:
                await producer.send("t", b"hello")
                assert [r.value for r in await c.getmany(timeout_ms=1000)] == [b"hello"]
        async with connect("memory://") as private:
            async with private.consumer(["t"], start_from="earliest") as c:
                assert await c.getmany(timeout_ms=10) == []
    finally:
        forget_named(name)


def test_connect_rejects_bad_urls_and_options() -> None:
    with pytest.raises(ValueError, match="unsupported bus URL"):
        connect("redis://x")
    with pytest.raises(ValueError, match="unknown option 'nope'"):
        connect("memory://?nope=1")
    with pytest.raises(ValueError, match="not a valid int"):
        connect("memory://?default_partitions=x")
    with pytest.raises(ValueError, match="not host:port"):
        connect("kafka://localhost")
    with pytest.raises(ValueError, match="no bootstrap"):
        connect("kafka://")
    assert isinstance(connect("memory://", default_partitions=4), MemoryBus)


async def test_send_validates_topic_and_types() -> None:
    async with connect("memory://") as bus:
        with pytest.raises(ValueError, match="invalid topic name"):
            await bus.send("bad topic!", b"x")
        with pytest.raises(TypeError, match="value must be bytes"):
            await bus.send("t", "text")  # type: ignore[arg-type]  # deliberately the wrong type: the check under test
    with pytest.raises(BusError, match="not started"):
        await bus.send("t", b"x")


async def test_default_partitions_and_keyed_placement() -> None:
    async with connect("memory://?default_partitions=5") as bus:
        meta = await bus.send("t", b"x", key=b"request-42")
        assert await bus.partitions_for("t") == [0, 1, 2, 3, 4]
        assert meta.partition == partition_for_key(b"request-42", 5)
        with pytest.raises(UnknownTopicError, match="unknown topic"):
            await bus.partitions_for("missing")


async def test_cancelled_getmany_loses_nothing() -> None:
    async with connect("memory://") as bus, bus.consumer(["t"], group_id="g", start_from="earliest") as c:
        task = asyncio.create_task(c.getmany(timeout_ms=5000))
        await wait_until(lambda: suspended(task))  # waiting for records
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await bus.send("t", b"x")
        assert [r.value for r in await c.getmany(timeout_ms=100)] == [b"x"]


async def test_stop_wakes_a_waiting_getmany_and_bus_stop_stops_consumers() -> None:
    bus = connect("memory://")
    await bus.start()
    c = bus.consumer(["t"])
    await c.start()
    task = asyncio.create_task(c.getmany(timeout_ms=10_000))
    await wait_until(lambda: suspended(task))  # waiting for records
    await bus.stop()
    with pytest.raises(BusError, match="stopped"):
        await asyncio.wait_for(task, 1.0)
    await bus.stop()  # idempotent
    await c.stop()
    with pytest.raises(BusError, match="cannot be restarted"):
        await c.start()


async def test_commit_in_on_revoked_counts_and_stale_commit_fails() -> None:
    async with connect("memory://") as bus:
        await bus.ensure_topics([TopicSpec("t", 2)])
        for i in range(4):
            await bus.send("t", str(i).encode(), key=str(i).encode())
        processed: dict[TopicPartition, int] = {}

        async def on_revoked(tps: set[TopicPartition]) -> None:
            await a.commit({tp: off for tp, off in processed.items() if tp in tps})

        a = bus.consumer(["t"], group_id="g", start_from="earliest", on_revoked=on_revoked)
        await a.start()
        for r in await a.getmany(timeout_ms=100):
            processed[r.tp] = r.offset + 1
        async with bus.consumer(["t"], group_id="g", start_from="earliest") as b:
            # a committed what it had processed when it lost its partition: b gets nothing again.
            assert await b.getmany(timeout_ms=50) == []
            lost = next(iter(b.assignment()))
            with pytest.raises(BusError, match="not assigned to this member"):
                await a.commit({lost: 0})
        await a.stop()


async def test_consumers_of_a_deleted_topic_read_nothing_and_commits_fail() -> None:
    async with connect("memory://") as bus:
        await bus.ensure_topics([TopicSpec("gone", 2), TopicSpec("kept", 1)])
        await bus.send("gone", b"old", key=b"k")
        async with bus.consumer(["gone", "kept"], group_id="g", start_from="earliest") as c:
            assert [r.value for r in await c.getmany(timeout_ms=100)] == [b"old"]
            await c.commit({TopicPartition("gone", partition_for_key(b"k", 2)): 1})
            assert await bus.delete_topics(["gone"]) == ["gone"]
            await bus.send("kept", b"still here")
            assert [r.value for r in await c.getmany(timeout_ms=100)] == [b"still here"]
            with pytest.raises(BusError, match="gone was deleted"):
                await c.commit({TopicPartition("gone", 0): 0})
        assert not any(tp.topic == "gone" for tp in bus.broker.groups["g"].committed), \
            "the deleted topic's committed offsets go with it"


async def test_bad_consumer_arguments() -> None:
    async with connect("memory://") as bus:
        with pytest.raises(ValueError, match="non-empty list"):
            bus.consumer("t")  # type: ignore[arg-type]  # deliberately the wrong type: the check under test
        with pytest.raises(ValueError, match="start_from"):
            bus.consumer(["t"], start_from="middle")  # type: ignore[arg-type]  # deliberately the wrong type: the check under test
        async with bus.consumer(["t"]) as c:
            with pytest.raises(BusError, match="not assigned"):
                c.pause(TopicPartition("other", 0))
            with pytest.raises(ValueError, match="max_records"):
                await c.getmany(max_records=0)


def test_partitioner_matches_aiokafka() -> None:
    import random

    from aiokafka.partitioner import murmur2 as reference

    from bus.partitioner import murmur2

    rng = random.Random(3)
    for n in range(40):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert murmur2(data) & 0x7FFFFFFF == reference(data) & 0x7FFFFFFF


async def test_retained_records_are_invisible_to_the_garbage_collector() -> None:
    # The log keeps bytes/ints/None/() only (untracked): 100k retained records must not feed the
    # young-generation threshold or be traversed by every collection (edge latency pauses).
    import gc

    async with connect("memory://") as bus:
        for i in range(100):
            await bus.send("t", b"v%d" % i, key=b"k" if i % 2 else None)
        part = bus.broker.topics["t"].partitions[0]
        stored = [*part.keys, *part.values, *part.stamps, *part.headers]
        assert len(stored) == 400 and not any(gc.is_tracked(x) for x in stored)


def test_topics_cli_takes_the_model_as_the_worker_does(capsys) -> None:
    """`lockgate topics ensure/delete --model default` (or a folder) means the served name the
    worker and edge use, not the literal `default`: otherwise no worker would read those topics."""
    from bus import TopicLayout
    from bus.memory import forget_named, named_broker
    from lockgate.cli import build_parser
    from tokenization.model_store import DEFAULT_MODEL

    name, served = "topics-cli-model", TopicLayout(namespace="ns").request_topics(DEFAULT_MODEL)
    common = ["--bus", f"memory://{name}", "--namespace", "ns", "--model", "default"]
    try:
        args = build_parser().parse_args(["topics", "ensure", *common, "--partitions", "1"])
        assert args.func(args) == 0
        made = {line.split()[1] for line in capsys.readouterr().out.splitlines()}
        assert set(served) <= made and not any(".default." in t for t in made)
        args = build_parser().parse_args(["topics", "delete", *common])
        assert args.func(args) == 0
        assert not set(served) & set(named_broker(name).topics)
    finally:
        forget_named(name)
