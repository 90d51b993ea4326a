"""One conformance suite, run against the memory bus and a real Kafka broker (``bus_url`` fixture)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from bus import (
    Bus,
    Consumer,
    Record,
    TopicLayout,
    TopicPartition,
    TopicSpec,
    UnknownTopicError,
    decode,
    decode_or_deadletter,
    encode,
)
from bus.deadletter import parse_dead_letter, read_dead_letters, send_dead_letter
from bus.messages import (
    Cancel,
    ChatMessage,
    Error,
    Finished,
    InferenceRequest,
    ReplyBatch,
    SamplingParams,
    Timings,
    TokenChunk,
    Usage,
    WorkerStatus,
)
from bus.partitioner import partition_for_key
from tests.waiting import wait_until

WAIT_S = 20.0  # generous upper bound for a record to show up on a loaded 2-core machine


async def drain(consumer: Consumer, n: int, timeout_s: float = WAIT_S) -> list[Record]:
    """Read until ``n`` records arrived (fails after ``timeout_s``)."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"got {len(out)} of {n} records within {timeout_s}s"
        out.extend(await consumer.getmany(timeout_ms=int(min(left, 0.5) * 1000)))
    return out


async def quiet(consumer: Consumer, seconds: float = 1.0) -> list[Record]:
    """Everything the consumer yields for ``seconds`` (used to assert that nothing arrives)."""
    out: list[Record] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        out.extend(await consumer.getmany(timeout_ms=int(left * 1000) + 1))
    return out


def ends(records: list[Record]) -> dict[int, int]:
    """Per partition, the offset to commit after processing ``records``."""
    out: dict[int, int] = {}
    for r in records:
        out[r.partition] = max(out.get(r.partition, 0), r.offset + 1)
    return out


def key_for_partition(partition: int, partitions: int, prefix: str = "k") -> bytes:
    for i in range(10_000):
        key = f"{prefix}{i}".encode()
        if partition_for_key(key, partitions) == partition:
            return key
    raise AssertionError("no key found")


def all_messages() -> list:
    return [
        InferenceRequest(
            request_id="r1",
            model="smol",
            prompt_token_ids=(1, 2, 3),
            sampling=SamplingParams(max_tokens=8, temperature=0.5, top_k=4, seed=7, stop=("\n",), logprobs=2),
            reply_to="lockgate.reply.edge-1",
            tenant="acme",
            tier=0,
            enqueued_at=1.5,
            deadline=9.5,
            prompt_text="hi",
            messages=(ChatMessage("user", "hi"),),
            cache_salt="s",
            attempt=1,
        ),
        TokenChunk("r1", 1, 0, (5, 6), "ab", 0, logprobs=(((5, -0.1),), ((6, -0.2),)), worker_id="w"),
        Finished("r1", 1, "stop", 2, Usage(3, 2, 1), Timings(0.1, 0.2, 0.01, 0.3), worker_id="w"),
        Error("r2", "overloaded", "busy", attempt=0, retry_after=1.0),
        Cancel("r1", "client"),
        WorkerStatus("w", "smol", 12.0, (1, 2, 3), (0.1, 0.2, 0.3), 4, 8, 0.5, 100, 50, 99.0, False),
        ReplyBatch((TokenChunk("r1", 0, 0, (1,), "a", 0), TokenChunk("r2", 1, 4, (2, 3), "bc", 9, None, "w")),
                   (Finished("r3", 0, "stop", 2, Usage(1, 2)),), (Error("r4", "expired", "late"),)),
    ]


async def test_round_trip_every_message_type(bus: Bus, name: str) -> None:
    msgs = all_messages()
    for m in msgs:
        meta = await bus.send(name, encode(m), key=b"r1", headers=[("h", b"v")])
        assert meta.topic == name and meta.offset >= 0
    async with bus.consumer([name], start_from="earliest") as c:
        recs = await drain(c, len(msgs))
    assert [decode(r.value) for r in recs] == msgs
    assert all(r.key == b"r1" and ("h", b"v") in r.headers and r.timestamp_ms > 0 for r in recs)
    assert [r.offset for r in recs] == list(range(len(msgs)))


async def test_per_key_order_across_partitions(bus: Bus, name: str) -> None:
    partitions, keys, per_key = 4, 40, 25
    await bus.ensure_topics([TopicSpec(name, partitions)])

    async def produce(k: int) -> None:
        for seq in range(per_key):
            meta = await bus.send(name, f"{k}:{seq}".encode(), key=f"req-{k}".encode())
            # Same partitioner as the Java client: a key lands on the same partition on both buses.
            assert meta.partition == partition_for_key(f"req-{k}".encode(), partitions)

    await asyncio.gather(*(produce(k) for k in range(keys)))
    async with bus.consumer([name], start_from="earliest") as c:
        recs = await drain(c, keys * per_key)
    seen: dict[str, list[int]] = defaultdict(list)
    parts: dict[str, set[int]] = defaultdict(set)
    for r in recs:
        k, seq = r.value.decode().split(":")
        seen[k].append(int(seq))
        parts[k].add(r.partition)
    assert len(seen) == keys
    assert all(s == list(range(per_key)) for s in seen.values()), "a key's records arrived out of order"
    assert all(len(p) == 1 for p in parts.values())
    assert len({p for ps in parts.values() for p in ps}) > 1, "keys should spread over partitions"


async def test_send_to_an_explicit_partition(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 3)])
    key = key_for_partition(0, 3)
    metas = [await bus.send(name, b"x%d" % p, key=key, partition=p) for p in (2, 1, 2)]
    assert [m.partition for m in metas] == [2, 1, 2]  # the partition wins over the key's own
    async with bus.consumer([name], start_from="earliest") as c:
        recs = await drain(c, 3)
    assert sorted((r.partition, r.value) for r in recs) == [(1, b"x1"), (2, b"x2"), (2, b"x2")]
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="partition"):
            await bus.send(name, b"y", partition=bad)
    with pytest.raises(ValueError, match="no partition 3"):
        await bus.send(name, b"y", partition=3)


async def test_group_failover_redelivers_uncommitted(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 2)])
    group = name + ".g"
    sent = {f"m{i}".encode() for i in range(10)}
    for v in sorted(sent):
        await bus.send(name, v, key=v)
    a = bus.consumer([name], group_id=group, start_from="earliest")
    await a.start()
    assert a.assignment() == {TopicPartition(name, 0), TopicPartition(name, 1)}
    got_a = await drain(a, 10)
    assert {r.value for r in got_a} == sent
    await a.stop()  # leaves without committing
    async with bus.consumer([name], group_id=group, start_from="earliest") as b:
        got_b = await drain(b, 10)
        assert {r.value for r in got_b} == sent
        await b.commit({TopicPartition(name, p): await_end for p, await_end in ends(got_b).items()})
    async with bus.consumer([name], group_id=group, start_from="earliest") as c:
        assert await quiet(c, 0.5) == [], "B committed everything: nothing is left for C"


async def test_committed_records_are_not_redelivered(bus: Bus, name: str) -> None:
    group = name + ".g"
    for i in range(10):
        await bus.send(name, f"m{i}".encode(), key=b"same")
    async with bus.consumer([name], group_id=group, start_from="earliest") as a:
        recs = await drain(a, 10)
        tp = recs[0].tp
        await a.commit({tp: recs[5].offset + 1})  # processed m0..m5
    async with bus.consumer([name], group_id=group, start_from="earliest") as b:
        again = await drain(b, 4)
        assert [r.value for r in again] == [b"m6", b"m7", b"m8", b"m9"]
        await b.commit({tp: again[-1].offset + 1})
        assert await quiet(b, 0.5) == []
    async with bus.consumer([name], group_id=group, start_from="earliest") as c:
        assert await quiet(c, 1.0) == []


async def test_rebalance_splits_partitions_and_calls_back(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 4)])
    group = name + ".g"
    events: dict[str, list[tuple[str, set[TopicPartition]]]] = defaultdict(list)

    def cb(who: str, what: str):
        async def f(tps: set[TopicPartition]) -> None:
            events[who].append((what, set(tps)))

        return f

    everything = {TopicPartition(name, p) for p in range(4)}
    a = bus.consumer([name], group_id=group, on_assigned=cb("a", "assigned"), on_revoked=cb("a", "revoked"))
    b = bus.consumer([name], group_id=group, on_assigned=cb("b", "assigned"), on_revoked=cb("b", "revoked"))
    async with a:
        assert a.assignment() == everything
        assert events["a"][-1] == ("assigned", everything)
        async with b:
            async def rebalanced() -> bool:
                if (a.assignment() and b.assignment() and a.assignment() | b.assignment() == everything
                        and not a.assignment() & b.assignment()):
                    return True
                await a.getmany(timeout_ms=100)  # the members' polls drive the rebalance
                await b.getmany(timeout_ms=100)
                return False

            await wait_until(rebalanced, timeout=WAIT_S, message="group did not rebalance")
            assert not a.assignment() & b.assignment()
            assert ("revoked", everything) in events["a"]
            assert events["b"][-1] == ("assigned", b.assignment())


async def test_pause_resume(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 2)])
    k0, k1 = key_for_partition(0, 2), key_for_partition(1, 2)
    tp0 = TopicPartition(name, 0)
    async with bus.consumer([name], start_from="earliest") as c:
        c.pause(tp0)
        assert c.paused() == {tp0}
        await bus.send(name, b"p0", key=k0)
        await bus.send(name, b"p1", key=k1)
        got = await drain(c, 1)
        assert [(r.partition, r.value) for r in got] == [(1, b"p1")]
        assert await quiet(c, 0.7) == [], "a paused partition must yield nothing"
        c.resume(tp0)
        assert c.paused() == set()
        got = await drain(c, 1)
        assert [(r.partition, r.value) for r in got] == [(0, b"p0")]


async def test_getmany_wakes_promptly(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 1)])
    async with bus.consumer([name], start_from="latest") as c:
        await c.getmany(timeout_ms=50)
        task = asyncio.create_task(c.getmany(timeout_ms=15_000))
        # Not synchronisation: the scenario. The record must arrive well into a long poll (a Kafka
        # fetch already in flight), which no public state of the consumer shows.
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await bus.send(name, b"x")
        recs = await task
        assert [r.value for r in recs] == [b"x"]
        assert time.monotonic() - t0 < 2.0, "getmany must return when a record arrives, not at its timeout"


async def test_ensure_topics_is_idempotent(bus: Bus, name: str) -> None:
    specs = [TopicSpec(name + ".a", 3), TopicSpec(name + ".b", 1)]
    assert sorted(await bus.ensure_topics(specs)) == [name + ".a", name + ".b"]
    assert await bus.ensure_topics(specs) == []
    assert await bus.ensure_topics(specs + [TopicSpec(name + ".c", 2)]) == [name + ".c"]
    assert await bus.partitions_for(name + ".a") == [0, 1, 2]
    assert await bus.partitions_for(name + ".c") == [0, 1]


async def test_a_failing_rebalance_callback_is_logged_and_the_member_goes_on(
        bus: Bus, name: str, caplog: pytest.LogCaptureFixture) -> None:
    await bus.ensure_topics([TopicSpec(name, 1)])

    def boom(tps: set[TopicPartition]) -> None:
        raise RuntimeError("callback bug")

    async with bus.consumer([name], group_id=name + ".g", start_from="earliest", on_assigned=boom) as c:
        await bus.send(name, b"after", key=b"k")
        assert [r.value for r in await drain(c, 1)] == [b"after"]
    assert any("on_assigned callback failed" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_delete_topics(bus: Bus, name: str) -> None:
    a, b = name + ".a", name + ".b"
    await bus.ensure_topics([TopicSpec(a, 2), TopicSpec(b, 1)])
    await bus.send(a, b"x", key=b"k")
    assert await bus.list_topics(name) == [a, b]
    assert await bus.delete_topics([a, a, name + ".never"]) == [a]

    async def gone() -> bool:
        try:
            await bus.partitions_for(a)
        except UnknownTopicError:
            return await bus.list_topics(name) == [b]
        return False

    # Kafka's metadata catches up after the controller: bounded wait
    await wait_until(gone, timeout=WAIT_S, interval=0.1, message=f"{a} unlisted and without partitions after delete_topics")
    assert await bus.partitions_for(b) == [0], "only the named topics are deleted"
    assert not any(t.startswith("__") for t in await bus.list_topics()), "internal topics are left out"
    assert await bus.delete_topics([a]) == [], "deleting again finds nothing: idempotent"
    assert await bus.delete_topics([]) == []
    with pytest.raises(ValueError, match="invalid topic name"):
        await bus.delete_topics(["no spaces allowed"])
    assert await bus.delete_topics([b]) == [b]


async def test_malformed_records_go_to_dead_letter_topic(bus: Bus, name: str) -> None:
    layout = TopicLayout(namespace=name)
    topic = layout.request_topic("m", 1)
    good = Cancel("r9")
    # a newer writer's record setting a field this build must understand and does not know
    newer = b'{"v":99,"type":"cancel","must":["scope"],"request_id":"x","scope":"all"}'
    await bus.send(topic, b"\x00not json", key=b"bad1")
    await bus.send(topic, newer, key=b"bad2")
    await bus.send(topic, encode(good), key=b"r9")
    decoded = []
    async with bus.consumer([topic], start_from="earliest") as c:
        for rec in await drain(c, 3):
            msg = await decode_or_deadletter(bus, layout, rec)
            if msg is not None:
                decoded.append(msg)
    assert decoded == [good], "consumption continues after dead letters"
    async with bus.consumer([layout.dead_letter_topic], start_from="earliest") as d:
        dead = [parse_dead_letter(r) for r in await drain(d, 2)]
    assert [(x.source_topic, x.source_offset, x.value, x.key) for x in dead] == [
        (topic, 0, b"\x00not json", b"bad1"),
        (topic, 1, newer, b"bad2"),
    ]
    assert "not JSON" in dead[0].reason
    assert "revision 99 needs field(s) ['scope']" in dead[1].reason


async def test_read_dead_letters_window_limit_and_missing_topic(bus: Bus, name: str) -> None:
    """``read_dead_letters`` (what ``lockgate dlq`` prints): nothing, and no topic made, where
    nothing was dead-lettered; then the letters of a time window, oldest first, up to a limit, with
    records that are not dead letters counted apart."""
    layout = TopicLayout(namespace=name)
    assert await read_dead_letters(bus, layout, 0, 2**62, idle_s=0.5) == ([], 0)
    with pytest.raises(UnknownTopicError):
        await bus.partitions_for(layout.dead_letter_topic)  # looking did not create it
    await bus.ensure_topics([TopicSpec(layout.dead_letter_topic, 1)])  # as a worker's start does
    src = Record(layout.request_topic("m", 1), 0, 7, b"k", b"junk", 1)
    await send_dead_letter(bus, layout, src, "old")
    # Not synchronisation: the input. Record timestamps are in ms (Kafka's from another clock): the
    # gaps put "old" clearly before the mark and the next letters clearly after it.
    await asyncio.sleep(0.05)
    mark = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    for i in range(3):
        await send_dead_letter(bus, layout, Record(src.topic, 0, 8 + i, b"k", b"junk", 1), f"new {i}")
    await bus.send(layout.dead_letter_topic, b"not a dead letter")
    letters, foreign = await read_dead_letters(bus, layout, mark, 2**62, idle_s=1.0)
    assert [(d.reason, d.source_offset) for d in letters] == [("new 0", 8), ("new 1", 9), ("new 2", 10)]
    assert foreign == 1 and all(d.dead_at_ms >= mark for d in letters)
    letters, _ = await read_dead_letters(bus, layout, 0, 2**62, limit=2, idle_s=1.0)
    assert [d.reason for d in letters] == ["old", "new 0"]
    with pytest.raises(ValueError, match="limit"):
        await read_dead_letters(bus, layout, 0, 1, limit=0)


async def test_groupless_replay_from_earliest_timestamp_latest(bus: Bus, name: str) -> None:
    for i in range(5):
        await bus.send(name, f"old{i}".encode(), key=b"k")
    # Not synchronisation: the input (timestamps clearly before and after the mark, as above).
    await asyncio.sleep(0.05)
    mark = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    for i in range(5):
        await bus.send(name, f"new{i}".encode(), key=b"k")
    async with bus.consumer([name], start_from="earliest") as c:
        assert [r.value.decode() for r in await drain(c, 10)] == [f"old{i}" for i in range(5)] + [
            f"new{i}" for i in range(5)
        ]
    async with bus.consumer([name], start_from=mark) as c:
        assert [r.value.decode() for r in await drain(c, 5)] == [f"new{i}" for i in range(5)]
        assert await quiet(c, 0.3) == []
    async with bus.consumer([name], start_from="latest") as c:
        assert await quiet(c, 0.3) == []
        await bus.send(name, b"later", key=b"k")
        assert [r.value for r in await drain(c, 1)] == [b"later"]


async def test_commit_without_group_is_an_error(bus: Bus, name: str) -> None:
    from bus import BusError

    await bus.send(name, b"x")
    async with bus.consumer([name], start_from="earliest") as c:
        rec = (await drain(c, 1))[0]
        with pytest.raises(BusError, match="group"):
            await c.commit({rec.tp: rec.offset + 1})


async def test_read_partition_from_a_time_to_the_end_as_of_the_call(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 2)])
    assert await bus.read_partition(name, 1, 0) == []  # empty partition: nothing, at once
    early = [await bus.send(name, b"e%d" % i, partition=1) for i in range(3)]
    await bus.send(name, b"other", partition=0)
    cut = int(time.time() * 1000) + 5
    while int(time.time() * 1000) <= cut:  # the next records get strictly later timestamps
        await asyncio.sleep(0.002)  # pacing the clock past `cut`, not waiting for a condition
    late = [await bus.send(name, b"l%d" % i, partition=1) for i in range(4)]
    everything = await bus.read_partition(name, 1, 0)
    assert [r.value for r in everything] == [b"e0", b"e1", b"e2", b"l0", b"l1", b"l2", b"l3"]
    assert [r.offset for r in everything] == [m.offset for m in early + late]
    assert all(r.partition == 1 and r.topic == name for r in everything)
    since = await bus.read_partition(name, 1, cut)
    assert [r.value for r in since] == [b"l0", b"l1", b"l2", b"l3"]
    assert [r.value for r in await bus.read_partition(name, 1, 0, limit=2)] == [b"e0", b"e1"]
    assert await bus.read_partition(name, 1, int(time.time() * 1000) + 60_000) == []  # nothing that late
    with pytest.raises(ValueError, match="no partition 5"):
        await bus.read_partition(name, 5, 0)
    with pytest.raises(UnknownTopicError):
        await bus.read_partition(name + ".missing", 0, 0)


async def test_lag_counts_what_waits_on_the_topic_paused_partitions_included(bus: Bus, name: str) -> None:
    await bus.ensure_topics([TopicSpec(name, 2)])
    for i in range(5):
        await bus.send(name, b"a%d" % i, partition=0)
    for i in range(3):
        await bus.send(name, b"b%d" % i, partition=1)
    async with bus.consumer([name], group_id=name + ".g", start_from="earliest") as c:
        await wait_until(lambda: len(c.assignment()) == 2, timeout=WAIT_S, message="both partitions assigned")
        tp0, tp1 = TopicPartition(name, 0), TopicPartition(name, 1)
        assert await c.lag() == {tp0: 5, tp1: 3}
        c.pause(tp1)
        got = await drain(c, 5)
        assert {r.partition for r in got} == {0}

        async def settled() -> bool:
            return await c.lag() == {tp0: 0, tp1: 3}

        await wait_until(settled, timeout=WAIT_S, message="lag 0 on the read partition, 3 on the paused one")
        await bus.send(name, b"b3", partition=1)
        assert (await c.lag())[tp1] == 4
