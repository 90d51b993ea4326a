"""A leaderless partition is a transient bus error, never a missing topic (issue #22): the pure
reading of one topic's metadata (``bus.kafka.metadata``), and ``partitions_for`` on real Kafka."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bus import BusError, TopicSpec, UnknownTopicError, connect
from bus.kafka.metadata import TopicNotReady, led_partitions
from tests.conftest import THREE_NODE_PORT


def meta(code: int = 0, leaders: tuple[int, ...] = (1, 2, 3)) -> dict:
    return {"error_code": code, "topic": "t", "partitions": [
        {"error_code": 0 if leader >= 0 else 5, "partition": i, "leader": leader} for i, leader in enumerate(leaders)]}


def test_only_unknown_topic_means_missing() -> None:
    assert led_partitions("t", None) is None
    assert led_partitions("t", {"error_code": 3, "topic": "t", "partitions": []}) is None  # UNKNOWN_TOPIC_OR_PARTITION
    assert led_partitions("t", meta(leaders=(2, 0, 1))) == [0, 1, 2]


def test_a_partition_without_a_leader_is_transient_not_missing() -> None:
    with pytest.raises(TopicNotReady, match=r"partitions \[1\] have no leader") as exc:
        led_partitions("t", meta(leaders=(0, -1, 2)))
    assert isinstance(exc.value, BusError) and not isinstance(exc.value, UnknownTopicError)
    with pytest.raises(TopicNotReady):  # LEADER_NOT_AVAILABLE for the whole topic (just created)
        led_partitions("t", {"error_code": 5, "topic": "t", "partitions": []})
    with pytest.raises(TopicNotReady):
        led_partitions("t", meta(leaders=()))


def test_other_topic_errors_are_bus_errors_not_missing() -> None:
    with pytest.raises(BusError, match="TopicAuthorizationFailed") as exc:
        led_partitions("t", {"error_code": 29, "topic": "t", "partitions": []})
    assert not isinstance(exc.value, (UnknownTopicError, TopicNotReady))


@pytest.mark.kafka
async def test_partitions_for_on_kafka_missing_vs_present(kafka_bootstrap: str) -> None:
    """On a real broker: a missing topic is UnknownTopicError (and is not created by asking), an
    existing one lists its partitions."""
    name = f"t.{uuid.uuid4().hex[:12]}"
    async with connect(f"kafka://{kafka_bootstrap}?client_id=lockgate-tests") as bus:
        with pytest.raises(UnknownTopicError):
            await bus.partitions_for(name)
        assert name not in await bus.list_topics(prefix=name)
        await bus.ensure_topics([TopicSpec(name, 3)])
        assert await bus.partitions_for(name) == [0, 1, 2]


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_partition_whose_leader_is_down_is_not_a_missing_topic(three_brokers) -> None:
    """3 brokers, a 3-partition topic with one replica each; one broker stops (SIGTERM, as in a
    rolling restart): its partition has no leader. ``partitions_for`` raises a transient
    ``BusError`` (never ``UnknownTopicError``), the worker's reply sender does not take the topic
    for missing (its requests would have been dead-lettered and committed), and once the broker is
    back the topic answers again."""
    import os
    import signal

    from devtools import kafka_local
    from engine_workers.worker.replies.sender import ReplySender
    from tests.waiting import wait_until

    name = f"t.{uuid.uuid4().hex[:12]}"
    async with connect(f"kafka://{three_brokers.bootstrap}?client_id=lockgate-tests") as bus:
        await bus.ensure_topics([TopicSpec(name, 3, replication=1)])
        assert await bus.partitions_for(name) == [0, 1, 2]
        pids = kafka_local.status(3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR).pids  # now: a node may have restarted
        victim = next(i for i, pid in enumerate(pids) if i != 0 and pid is not None)
        pid = pids[victim]
        assert pid is not None
        os.kill(pid, signal.SIGTERM)  # a broker of the test cluster

        async def leaderless() -> bool:
            try:
                await bus.partitions_for(name)
            except TopicNotReady:
                return True
            return False

        await wait_until(leaderless, timeout=60, interval=0.5, message="a partition without a leader")
        sender = ReplySender(bus, "w")
        assert await sender.verify(name) is None  # not "reply topic ... does not exist"
        with pytest.raises(BusError) as exc:
            await bus.partitions_for(name)
        assert not isinstance(exc.value, UnknownTopicError)
        await sender.stop()
        await wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60, interval=0.2,
                         message="the stopped broker's process gone")  # else start() takes it for running
        await asyncio.to_thread(kafka_local.start, 3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR, 180.0)
        parts = await wait_until(lambda: _led(bus, name), timeout=60, interval=0.5, message="every partition led again")
        assert parts == [0, 1, 2]


async def _led(bus, name: str) -> list[int] | None:
    try:
        return await bus.partitions_for(name)
    except TopicNotReady:
        return None
