"""ReplyCollector: assembly, dedupe of re-sent chunks after a worker restart, unknown ids (memory bus)."""

from __future__ import annotations

import asyncio

import pytest

from bus import Error, Finished, MemoryBus, TokenChunk, Usage, encode
from producers.collector import ReplyCollector


async def test_collector_dedupes_rerun_and_keeps_order():
    bus = MemoryBus()
    await bus.start()
    try:
        await bus.ensure_topics([])
        col = ReplyCollector(bus, "r", start_from="earliest")
        fut = col.expect("a")
        fut_err = col.expect("b")
        await col.start()
        sends = [
            TokenChunk("a", 0, 0, (1,), "x", 0), TokenChunk("a", 0, 1, (2, 3), "yz", 1),
            TokenChunk("zzz", 0, 0, (9,), "?", 0),  # nobody waits for it
            TokenChunk("a", 1, 0, (1,), "x", 0), TokenChunk("a", 1, 1, (2, 3), "yz", 1),  # re-run from 0
            TokenChunk("a", 1, 2, (3, 4), "z!", 2),  # overlaps: only token 4 / "!" are new
            Finished("a", 1, "length", 4, Usage(3, 4)),
            Error("b", "overloaded", "busy", retry_after=1.0),
        ]
        for m in sends:
            await bus.send("r", encode(m), key=m.request_id.encode())
        reply = await asyncio.wait_for(fut, 5)
        assert reply.token_ids == (1, 2, 3, 4) and reply.text == "xyz!" and reply.ok
        assert reply.duplicates == 2 and reply.gaps == 0 and len(reply.chunk_times) == 3
        err = await asyncio.wait_for(fut_err, 5)
        assert not err.ok and err.error.code == "overloaded"
        assert col.unknown == 1 and not col.pending
        late = col.expect("c")
        await col.stop()
        assert late.cancelled()
    finally:
        await bus.stop()


async def test_retire_deletes_the_topic_only_when_nothing_may_still_answer():
    """A run's reply topic goes when every request it waited for was answered; a request given up
    on (timeout, cancel) may still be answered there, so then the topic stays."""
    from bus import TopicSpec, UnknownTopicError

    async with MemoryBus() as bus:
        await bus.ensure_topics([TopicSpec("r.done", 2), TopicSpec("r.open", 2)])
        done = ReplyCollector(bus, "r.done")
        await done.start()
        fut = done.expect("a")
        await bus.send("r.done", encode(Finished("a", 0, "length", 1, Usage(1, 1))), key=b"a")
        await asyncio.wait_for(fut, 5)
        assert await done.retire() is True and done.abandoned == 0
        with pytest.raises(UnknownTopicError):
            await bus.partitions_for("r.done")

        given_up = ReplyCollector(bus, "r.open")
        await given_up.start()
        given_up.expect("slow")
        given_up.forget("slow")  # a timeout: its reply may still come
        assert await given_up.retire() is False and given_up.abandoned == 1
        assert await bus.partitions_for("r.open") == [0, 1]

        waiting = ReplyCollector(bus, "r.open")
        await waiting.start()
        waiting.expect("never")  # still pending when the run stops (a cancelled batch)
        assert await waiting.retire() is False and waiting.abandoned == 1
        assert await bus.partitions_for("r.open") == [0, 1]
