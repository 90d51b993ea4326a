"""``bus.CompactedTable`` on the memory bus: one table shared by several processes (here: several
tables on one broker), read back by a cold one, deletes honoured by all, bounded by age, count and
size."""

from __future__ import annotations

import time

import pytest

from bus import BusError, CompactedTable, MemoryBroker, MemoryBus, TopicSpec


def spec(retention_ms: int = 60_000) -> TopicSpec:
    return TopicSpec("t.table.x", 3, 1, retention_ms)


async def test_writes_are_read_on_every_table_and_by_one_started_cold():
    broker = MemoryBroker()
    async with MemoryBus("memory://", broker) as b1, MemoryBus("memory://", broker) as b2:
        async with CompactedTable(b1, spec()) as a, CompactedTable(b2, spec()) as b:
            await a.put("k1", b"one")
            assert a.peek("k1") == b"one"  # read-your-writes at once
            assert await b.get("k1") == b"one"  # the other one catches up before answering a miss
            await b.put("k1", b"uno")
            await b.put("k2", b"two")
            assert await a.get("k2") == b"two" and a.peek("k1") == b"uno"
            await a.delete("k1")
            assert a.peek("k1") is None
            async with CompactedTable(b2, spec()) as cold:  # started after every write
                assert await cold.get("k2") == b"two" and await cold.get("k1") is None
            await b.sync()
            assert b.peek("k1") is None and await b.get("nope") is None


async def test_bounds_age_count_and_size():
    now = [time.time()]  # record timestamps are the wall clock
    async with MemoryBus("memory://") as bus:
        t = CompactedTable(bus, spec(retention_ms=10_000), max_entries=2, max_value_bytes=8, clock=lambda: now[0])
        async with t:
            with pytest.raises(ValueError, match="max_value_bytes"):
                await t.put("big", b"x" * 9)
            with pytest.raises(ValueError, match="non-empty"):
                await t.put("empty", b"")
            for k in ("a", "b", "c"):
                await t.put(k, b"v")
            assert len(t) == 2 and t.peek("a") is None and t.peek("c") == b"v"  # the oldest evicted
            now[0] += 11.0  # past retention: gone here too, whatever the broker still holds
            assert t.peek("c") is None
    async with MemoryBus("memory://") as bus:
        async with CompactedTable(bus, spec(), max_value_bytes=4, max_bytes=10) as t:
            for k in ("a", "b", "c"):
                await t.put(k, b"1234")
            assert t.peek("a") is None and t.peek("b") == t.peek("c") == b"1234"  # 12 bytes > 10: a goes
            await t.put("b", b"12")  # replaced: its old size no longer counts
            await t.put("d", b"1234")
            assert t.peek("b") == b"12" and t.peek("c") == t.peek("d") == b"1234"
    with pytest.raises(ValueError):
        CompactedTable(bus, spec(), max_entries=0)
    with pytest.raises(ValueError):
        CompactedTable(bus, spec(), max_value_bytes=8, max_bytes=4)


async def test_a_table_not_started_refuses_to_wait():
    async with MemoryBus("memory://") as bus:
        with pytest.raises(BusError, match="not started"):
            await CompactedTable(bus, spec()).sync()
