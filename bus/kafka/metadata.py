"""What one topic's Kafka metadata says about it: missing, usable, or not ready yet. Pure.

Only ``UNKNOWN_TOPIC_OR_PARTITION`` means the topic does not exist. A partition without a leader
(``leader`` -1: a leader election in progress, the leader's broker down on a multi-broker cluster,
a topic just created) or a topic-level ``LEADER_NOT_AVAILABLE`` is a transient state: the topic is
there and will be usable again once a leader is elected. Taking that for a missing topic made a
worker dead-letter (and commit) every in-flight request of a topic during a leader election.
"""

from __future__ import annotations

from typing import Any

from aiokafka.errors import UnknownTopicOrPartitionError, for_code

from bus.base import BusError


class TopicNotReady(BusError):
    """The topic exists but some partition has no leader (or the broker says the topic is not
    available yet): transient, ask again after a backoff."""


def led_partitions(topic: str, meta: dict[str, Any] | None) -> list[int] | None:
    """The partition ids of ``topic`` from its metadata entry (``MetadataResponse`` topic as a
    dict: ``error_code``, ``partitions`` with ``partition``/``leader``), or ``None`` when the topic
    does not exist. Raises :class:`TopicNotReady` when a partition has no leader, and
    :class:`BusError` for any other topic error (authorization, invalid name)."""
    if meta is None:
        return None
    code = meta["error_code"]
    if code != 0:
        err = for_code(code)
        if err is UnknownTopicOrPartitionError:
            return None
        if getattr(err, "retriable", False):  # LEADER_NOT_AVAILABLE and the like
            raise TopicNotReady(f"topic {topic!r} is not available yet: {err.__name__}")
        raise BusError(f"metadata for topic {topic!r}: {err.__name__}")
    parts = meta["partitions"]
    if not parts:
        raise TopicNotReady(f"topic {topic!r} has no partitions in its metadata yet")
    leaderless = sorted(p["partition"] for p in parts if p["leader"] < 0)
    if leaderless:
        raise TopicNotReady(f"topic {topic!r}: partitions {leaderless} have no leader (election in progress?)")
    return sorted(p["partition"] for p in parts)
