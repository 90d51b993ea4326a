"""The Kafka bus's standing partition reader (bus/kafka/reader.py): one connection serves every
``read_partition``, reads run concurrently, and a cached leader of a topic deleted meanwhile never
hangs a read nor re-creates the topic (the conformance suite covers the read's semantics)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bus import TopicSpec, UnknownTopicError, connect

pytestmark = pytest.mark.kafka


async def test_one_standing_connection_serves_concurrent_reads(kafka_bootstrap: str) -> None:
    topic = f"t.reader-{uuid.uuid4().hex[:10]}"
    async with connect(f"kafka://{kafka_bootstrap}") as bus:
        await bus.ensure_topics([TopicSpec(topic, 3)])
        await bus.prepare_reads([topic, topic + ".missing"])  # a missing topic is skipped, not raised
        sent = {p: [await bus.send(topic, b"%d-%d" % (p, i), partition=p) for i in range(5 + p)] for p in range(3)}
        reads = await asyncio.gather(*(bus.read_partition(topic, p, 0) for p in range(3) for _ in range(4)))
        for k, got in enumerate(reads):
            p = k // 4
            assert [r.value for r in got] == [b"%d-%d" % (p, i) for i in range(5 + p)]
            assert [r.offset for r in got] == [m.offset for m in sent[p]]
        reader = bus._reader  # type: ignore[attr-defined]
        client = reader._client
        assert client is not None
        await bus.read_partition(topic, 0, 0)
        assert reader._client is client, "a read started a client of its own"
        await bus.delete_topics([topic])


async def test_a_topic_deleted_after_a_read_is_unknown_not_recreated(kafka_bootstrap: str) -> None:
    topic = f"t.reader-{uuid.uuid4().hex[:10]}"
    async with connect(f"kafka://{kafka_bootstrap}") as bus:
        await bus.ensure_topics([TopicSpec(topic, 2)])
        await bus.send(topic, b"x", partition=1)
        assert [r.value for r in await bus.read_partition(topic, 1, 0)] == [b"x"]  # its leader is cached now
        await bus.delete_topics([topic])
        with pytest.raises(UnknownTopicError):
            await bus.read_partition(topic, 1, 0, timeout_s=20)
        assert topic not in await bus.list_topics(topic)
