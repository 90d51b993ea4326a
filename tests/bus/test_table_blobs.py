"""The bus's two storage helpers, on the memory bus and on real Kafka: a compacted-topic table
(``bus.Table``: every opener sees the same entries, last write wins, reads its own writes) and
chunked blobs (``bus.BlobStore``: a payload larger than one record, read back exactly, even with
another blob's chunks written in between)."""

from __future__ import annotations

import asyncio
import os

import pytest

from bus import BlobStore, Bus, BusError, Table
from tests.waiting import wait_until


async def test_a_table_is_shared_replayed_and_reads_its_own_writes(bus: Bus, name: str) -> None:
    a = Table(bus, f"{name}.tab", partitions=3)
    await a.start()
    try:
        await a.put("x", b"1")
        await a.put("y", b"2")
        await a.put("x", b"3")
        await a.delete("y")
        assert a.get("x") == b"3" and a.get("y") is None  # at once, before the follower reads them back
        with pytest.raises(ValueError):
            await a.put("z", b"")
        b = Table(bus, f"{name}.tab", partitions=3)  # another process opening it: replays the topic
        await b.start()
        try:
            assert b.get("x") == b"3" and b.get("y") is None
            await b.put("x/1", b"p")
            await b.put("w", b"q")
            await wait_until(lambda: a.get("x/1") == b"p" and a.get("w") == b"q", timeout=20)  # followed live
            assert sorted(k for k, _ in a.items("x")) == ["x", "x/1"]
            for i in range(20):  # a's own rapid writes never roll back while the follower catches up
                await a.put("c", str(i).encode())
                assert a.get("c") == str(i).encode()
            await wait_until(lambda: b.get("c") == b"19", timeout=20)
            await asyncio.sleep(0.3)
            assert a.get("c") == b"19"
        finally:
            await b.stop()
    finally:
        await a.stop()


async def test_blobs_larger_than_a_record_read_back_exactly(bus: Bus, name: str) -> None:
    store = BlobStore(bus, f"{name}.blobs", partitions=1, chunk_bytes=64 * 1024)
    await store.start()
    big, other = os.urandom(300 * 1024 + 17), os.urandom(200 * 1024)
    one, two = await asyncio.gather(store.write("one", big), store.write("two", other))  # chunks interleave
    assert one.chunks == 5 and two.chunks == 4 and one.size == len(big)
    assert await store.read(one) == big and await store.read(two) == other
    empty = await store.write("empty", b"")
    assert empty.chunks == 0 and await store.read(empty) == b""
    await store.delete(two)
    assert await store.read(one) == big  # the other blob is untouched
    forged = type(one)(**{**one.to_json(), "sha256": "0" * 64})
    with pytest.raises(BusError):
        await store.read(forged)
    assert type(one).from_json(one.to_json()) == one
