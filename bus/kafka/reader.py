"""Read one partition of a Kafka topic, from a point in time up to its end as of the call.

A throwaway, group-less ``AIOKafkaConsumer`` assigned to the one partition: the first offset at
or after ``since_ms`` (the broker's time index), the partition's end offset, then fetches until the
position reaches that end. Used where a process must learn what a partition already holds (the
worker resuming a request from the tokens already published for it), so it reads a bounded slice
and never joins a group or commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition as KTP

from bus.base import BusError, Record
from bus.kafka.outage import throttle_metadata_refresh


async def read_kafka_partition(bootstrap: str, client_id: str, request_timeout_ms: int, topic: str, partition: int,
                               since_ms: int, limit: int, timeout_s: float,
                               client_kwargs: Mapping[str, Any] | None = None) -> list[Record]:
    """The records of ``topic[partition]`` with offsets from the first at/after ``since_ms`` up to the
    partition's end at the call, at most ``limit`` (the oldest first). Raises :class:`BusError` when
    the broker cannot be read within ``timeout_s``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id=f"{client_id}-reader", group_id=None,
                                enable_auto_commit=False, request_timeout_ms=request_timeout_ms,
                                fetch_max_wait_ms=100, retry_backoff_ms=100, **(client_kwargs or {}))
    throttle_metadata_refresh(consumer._client)
    ktp = KTP(topic, partition)
    out: list[Record] = []
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            consumer.assign([ktp])
            end = (await consumer.end_offsets([ktp]))[ktp]
            found = (await consumer.offsets_for_times({ktp: since_ms}))[ktp]
            start = found.offset if found is not None else end
            if start >= end:
                return out
            consumer.seek(ktp, start)
            while len(out) < limit:
                batches = await consumer.getmany(ktp, timeout_ms=200, max_records=min(2048, limit - len(out)))
                for m in batches.get(ktp, ()):
                    if m.offset >= end:
                        return out
                    headers = tuple((k, bytes(v) if v is not None else b"") for k, v in (m.headers or ()))
                    out.append(Record(topic, partition, m.offset, m.key, m.value or b"", m.timestamp, headers))
                if await consumer.position(ktp) >= end:
                    return out
    except TimeoutError:
        raise BusError(f"reading {topic}[{partition}] took longer than {timeout_s:g}s") from None
    except KafkaError as exc:
        raise BusError(f"reading {topic}[{partition}] failed: {exc!r}") from exc
    finally:
        await consumer.stop()
    return out
