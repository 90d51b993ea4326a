"""ReplySender on the memory bus: one record per reply partition per round, each request's replies
in order and in one partition, finals acknowledged after their tokens, drop and failure paths."""

from __future__ import annotations

import asyncio

import pytest

from bus import (
    BusError,
    Error,
    Finished,
    MemoryBus,
    Record,
    ReplyBatch,
    TokenChunk,
    TopicSpec,
    UnknownTopicError,
    Usage,
    connect,
    decode,
    partition_for_key,
    replies_of,
)
from engine_workers.worker.replies.sender import ReplySender
from tests.waiting import wait_until

TOPIC = "lockgate.reply.t"


@pytest.fixture
async def bus():
    async with connect("memory://") as b:
        await b.ensure_topics([TopicSpec(TOPIC, 3)])
        yield b


async def records(bus: MemoryBus, topic: str = TOPIC) -> list[Record]:
    async with bus.consumer([topic], start_from="earliest") as c:
        out: list[Record] = []
        while recs := await c.getmany(timeout_ms=50):
            out += recs
        return out


def fin(rid: str, n: int) -> Finished:
    return Finished(rid, 0, "length", n, Usage(1, n))


async def settle(sender: ReplySender, timeout_s: float = 5.0) -> None:
    """Wait until no round is in flight (requests without a final stay tracked: not "idle")."""
    await wait_until(lambda: not sender._tasks, timeout=timeout_s, interval=0.005, message="no round in flight")


async def test_one_record_per_partition_per_round(bus: MemoryBus) -> None:
    sender = ReplySender(bus, "w")
    ids = [f"req-{i}" for i in range(12)]
    acked: list[str] = []
    for rid in ids:  # one engine step: a token for every request, and half of them finish
        sender.chunk(rid, TOPIC, rid, 0, 0, (7,), "a", 0)
    for rid in ids[:6]:
        sender.final(rid, TOPIC, rid, fin(rid, 1), lambda rid=rid: acked.append(rid))
    await settle(sender)
    recs = await records(bus)
    parts = {partition_for_key(rid.encode(), 3) for rid in ids}
    assert len(recs) == len(parts) == sender.records_sent  # not one per request
    assert sender.replies_sent == 18
    seen: list = []
    for r in recs:
        msg = decode(r.value)
        assert isinstance(msg, ReplyBatch)
        for m in replies_of(msg):
            assert partition_for_key(m.request_id.encode(), 3) == r.partition  # a request's own partition
            seen.append(m)
    assert sorted(m.request_id for m in seen if isinstance(m, TokenChunk)) == sorted(ids)
    assert sorted(m.request_id for m in seen if isinstance(m, Finished)) == sorted(ids[:6])
    assert sorted(acked) == sorted(ids[:6])
    assert len(sender) == 6  # the unfinished ones stay tracked until their final
    await sender.stop()


async def test_a_lone_request_sends_plain_messages_in_order(bus: MemoryBus) -> None:
    sender = ReplySender(bus, "w")
    acked = asyncio.Event()
    sender.chunk("k", TOPIC, "r", 2, 0, (1,), "a", 0)  # goes out alone
    await asyncio.sleep(0)  # one loop turn, not a wait for time: the round task starts and takes it
    sender.chunk("k", TOPIC, "r", 2, 1, (2,), "b", 1)  # these three wait for the first ack:
    sender.chunk("k", TOPIC, "r", 2, 2, (3,), "c", 2)  # coalesced into one chunk,
    sender.final("k", TOPIC, "r", fin("r", 3), acked.set)  # with the final behind it
    with pytest.raises(RuntimeError, match="chunk after final"):
        sender.chunk("k", TOPIC, "r", 2, 3, (4,), "d", 3)
    await asyncio.wait_for(acked.wait(), 5)
    msgs = [m for r in await records(bus) for m in replies_of(decode(r.value))]
    assert msgs == [TokenChunk("r", 2, 0, (1,), "a", 0, None, "w"), TokenChunk("r", 2, 1, (2, 3), "bc", 1, None, "w"),
                    fin("r", 3)]
    assert len({r.partition for r in await records(bus)}) == 1
    assert len(sender) == 0
    await sender.stop()


async def test_drop_forgets_queued_replies_and_never_acks(bus: MemoryBus) -> None:
    sender = ReplySender(bus, "w")
    acked: list[str] = []
    sender.chunk("a", TOPIC, "a", 0, 0, (1,), "x", 0)
    sender.chunk("b", TOPIC, "b", 0, 0, (1,), "x", 0)
    sender.final("b", TOPIC, "b", fin("b", 1), lambda: acked.append("b"))
    sender.drop("b")  # partition revoked before the round went out
    sender.final("a", TOPIC, "a", fin("a", 1), lambda: acked.append("a"))
    await settle(sender)
    msgs = [m for r in await records(bus) for m in replies_of(decode(r.value))]
    assert {m.request_id for m in msgs} == {"a"} and acked == ["a"] and len(sender) == 0
    await sender.stop()


async def test_a_failed_record_fails_each_request_in_it_and_leaves_no_gap(bus: MemoryBus,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    failed: list[tuple[str, str | None]] = []
    sender = ReplySender(bus, "w", retries=1, on_failed=lambda k, why: failed.append((k, why)))
    real_send = bus.send
    calls = 0

    async def broken(topic, value, key=None, headers=(), partition=None):
        nonlocal calls
        calls += 1
        raise BusError("broker gone")

    monkeypatch.setattr(bus, "send", broken)
    same = [f"r{i}" for i in range(40) if partition_for_key(f"r{i}".encode(), 3) == 0][:2]
    for rid in same:
        sender.chunk(rid, TOPIC, rid, 0, 0, (1,), "x", 0)
    await wait_until(lambda: calls >= 1)  # the round is in flight (retrying); more tokens queue meanwhile
    sender.chunk(same[0], TOPIC, same[0], 0, 1, (2,), "y", 1)
    await settle(sender)  # the round has given up
    # one record, tried 1 + retries times; the topic exists, so not undeliverable: a bus failure
    assert sorted(failed) == sorted((rid, None) for rid in same) and calls == 2
    assert len(sender) == 0
    monkeypatch.setattr(bus, "send", real_send)
    await settle(sender)
    assert await records(bus) == []  # seq 1 was not sent after the failed seq 0
    await sender.stop()


async def test_partition_count_unreadable_falls_back_to_one_keyed_record_per_request(
        bus: MemoryBus, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unreadable(topic: str) -> list[int]:
        raise BusError("metadata timed out")  # the broker could not be asked: not "missing"

    monkeypatch.setattr(bus, "partitions_for", unreadable)
    sender = ReplySender(bus, "w")
    for rid in ("a", "b", "c"):
        sender.chunk(rid, TOPIC, rid, 0, 0, (1,), "x", 0)
        sender.final(rid, TOPIC, rid, Error(rid, "expired", "late"), lambda: None)
    await settle(sender)
    recs = await records(bus, TOPIC)
    assert len(recs) == 3 and all(r.key == decode(r.value).chunks[0].request_id.encode() for r in recs)
    assert all(r.partition == partition_for_key(r.key, 3) for r in recs)  # where Kafka would key them
    await sender.stop()


async def test_missing_reply_topic_is_undeliverable_and_nothing_is_sent(bus: MemoryBus) -> None:
    """A reply topic nobody created: each request is reported undeliverable (once, with a reason
    naming the topic), nothing is sent (which would create the topic for no reader), and requests
    to an existing topic in the meantime are not held up."""
    failed: list[tuple[str, str | None]] = []
    acked: list[str] = []
    sender = ReplySender(bus, "w", on_failed=lambda k, why: failed.append((k, why)))
    gone = "lockgate.reply.gone"
    for rid in ("a", "b"):
        sender.chunk(rid, gone, rid, 0, 0, (1,), "x", 0)
    sender.chunk("ok", TOPIC, "ok", 0, 0, (1,), "x", 0)
    sender.final("ok", TOPIC, "ok", fin("ok", 1), lambda: acked.append("ok"))
    await wait_until(lambda: acked == ["ok"])
    assert acked == ["ok"] and failed == []  # the missing topic is still being checked again
    await settle(sender)
    assert sorted(failed) == [(rid, f"reply topic {gone!r} does not exist") for rid in ("a", "b")]
    assert len(sender) == 0
    with pytest.raises(UnknownTopicError):
        await bus.partitions_for(gone)  # not created by a send
    await sender.stop()


async def test_reply_topic_deleted_after_first_use_is_undeliverable(bus: MemoryBus,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The count was cached, then the requester's topic went away and sends fail: the failure is
    checked against the topic at once (no waiting out every retry) and reported undeliverable."""
    failed: list[tuple[str, str | None]] = []
    sender = ReplySender(bus, "w", retries=5, on_failed=lambda k, why: failed.append((k, why)))
    sender.chunk("a", TOPIC, "a", 0, 0, (1,), "x", 0)
    await settle(sender)
    assert sender.records_sent == 1
    calls = 0

    async def broken(*args, **kwargs):
        nonlocal calls
        calls += 1
        raise BusError("unknown topic or partition")

    await bus.delete_topics([TOPIC])
    monkeypatch.setattr(bus, "send", broken)
    sender.chunk("a", TOPIC, "a", 0, 1, (2,), "y", 1)
    await settle(sender)
    assert failed == [("a", f"reply topic {TOPIC!r} does not exist")] and calls == 1
    await sender.stop()


async def test_stop_cancels_rounds_in_flight(bus: MemoryBus, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = asyncio.Event()
    real_send = bus.send
    sending: list[str] = []

    async def slow(topic: str, *args: object, **kwargs: object) -> object:
        sending.append(topic)
        await gate.wait()
        return await real_send(topic, *args, **kwargs)

    monkeypatch.setattr(bus, "send", slow)
    sender = ReplySender(bus, "w")
    sender.chunk("a", TOPIC, "a", 0, 0, (1,), "x", 0)
    await wait_until(lambda: sending)  # the round is in flight, held in its send
    await sender.stop()
    await sender.stop()  # idempotent
    assert len(sender) == 0 and not sender._tasks


async def test_a_topic_recreated_with_fewer_partitions_is_re_read(bus: MemoryBus) -> None:
    sender = ReplySender(bus, "w")
    rid = next(f"r{i}" for i in range(100) if partition_for_key(f"r{i}".encode(), 3) == 2)
    sender.chunk(rid, TOPIC, rid, 0, 0, (1,), "a", 0)
    await settle(sender)  # the count (3) is cached, the request's partition is 2
    await bus.delete_topics([TOPIC])
    await bus.ensure_topics([TopicSpec(TOPIC, 1)])
    acked = asyncio.Event()
    sender.chunk(rid, TOPIC, rid, 0, 1, (2,), "b", 1)
    sender.final(rid, TOPIC, rid, fin(rid, 2), acked.set)
    await asyncio.wait_for(acked.wait(), 5)  # sent (keyed) instead of failing on partition 2
    msgs = [m for r in await records(bus) for m in replies_of(decode(r.value))]
    assert msgs == [TokenChunk(rid, 0, 1, (2,), "b", 1, None, "w"), fin(rid, 2)]
    sender.chunk("s", TOPIC, "s", 0, 0, (1,), "x", 0)
    await settle(sender)
    assert sender.partition_count(TOPIC) == 1  # the next round read the new count
    await sender.stop()


async def test_a_raising_callback_does_not_stop_the_others(bus: MemoryBus) -> None:
    sender = ReplySender(bus, "w")
    acked: list[str] = []

    def boom() -> None:
        raise RuntimeError("caller bug")

    for rid in ("a", "b", "c"):
        sender.final(rid, TOPIC, rid, fin(rid, 0), boom if rid == "a" else (lambda rid=rid: acked.append(rid)))
    await settle(sender)
    assert sorted(acked) == ["b", "c"] and len(sender) == 0
    sender.chunk("d", TOPIC, "d", 0, 0, (1,), "x", 0)  # and the sender still works
    await settle(sender)
    assert any(m.request_id == "d" for r in await records(bus) for m in replies_of(decode(r.value)))
    await sender.stop()


async def test_a_topic_found_missing_is_remembered_briefly_and_checked_again(bus: MemoryBus,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_workers.worker.replies.topics as rt

    sender = ReplySender(bus, "w", on_failed=lambda k, why: None)
    gone = "lockgate.reply.gone"
    assert await sender.topics.still_missing(gone) is False  # never looked at: nothing known
    sender.chunk("a", gone, "a", 0, 0, (1,), "x", 0)
    await settle(sender)
    assert await sender.topics.still_missing(gone) is True  # found missing, and still is
    monkeypatch.setattr(rt, "MISSING_TTL_S", 0.05)
    await asyncio.sleep(0.1)  # not synchronisation: lets the (shortened) TTL pass, the thing under test
    assert await sender.topics.still_missing(gone) is False  # remembered only briefly
    monkeypatch.setattr(rt, "MISSING_TTL_S", 2.0)
    sender.chunk("b", gone, "b", 0, 0, (1,), "x", 0)
    await settle(sender)
    await bus.ensure_topics([TopicSpec(gone, 1)])
    assert await sender.topics.still_missing(gone) is False  # created since: asked again, never taken for missing
    await sender.stop()


async def test_verify_checks_a_topic_once_and_shares_the_check(bus: MemoryBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify`` (the worker's gate before a request runs): an existing topic -> None, cached (no
    second metadata request); a missing one -> the dead letter's reason after the rechecks; callers
    at the same time share one check; a topic created later verifies."""
    import engine_workers.worker.replies.topics as rt

    monkeypatch.setattr(rt, "MISSING_RECHECK_S", (0.01, 0.01))
    asked: list[str] = []
    real = bus.partitions_for

    async def counting(topic: str) -> list[int]:
        asked.append(topic)
        return await real(topic)

    monkeypatch.setattr(bus, "partitions_for", counting)
    sender = ReplySender(bus, "w")
    assert not sender.known(TOPIC)
    assert await asyncio.gather(*(sender.verify(TOPIC) for _ in range(5))) == [None] * 5
    assert sender.known(TOPIC) and asked == [TOPIC]  # one check for five callers
    assert await sender.verify(TOPIC) is None and asked == [TOPIC]  # cached
    gone = "lockgate.reply.gone"
    reasons = await asyncio.gather(*(sender.verify(gone) for _ in range(3)))
    assert reasons == [rt.missing_topic_reason(gone)] * 3 and asked.count(gone) == 3  # first check + 2 rechecks
    assert not sender.known(gone)
    assert await sender.verify(gone) == rt.missing_topic_reason(gone) and asked.count(gone) == 4  # remembered: one check
    await bus.ensure_topics([TopicSpec(gone, 2)])
    assert await sender.verify(gone) is None and sender.known(gone)
    sender.chunk("a", gone, "a", 0, 0, (1,), "x", 0)  # the rounds use the cached count
    await settle(sender)
    assert asked.count(gone) == 5  # one check found it created, and gave its count
    await sender.stop()
