"""A leaderless partition is a transient bus error, never a missing topic (issue #22): the pure
reading of one topic's metadata (``bus.kafka_metadata``), and ``partitions_for`` on real Kafka."""

from __future__ import annotations

import uuid

import pytest

from bus import BusError, TopicSpec, UnknownTopicError, connect
from bus.kafka_metadata import TopicNotReady, led_partitions


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
