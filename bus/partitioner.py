"""Kafka's default key partitioner, in pure Python: ``murmur2(key) & 0x7fffffff % partitions``.

The memory bus uses it so a key lands on the same partition number as with Kafka's Java client and
aiokafka's ``DefaultPartitioner`` (tests check the two agree).
"""

from __future__ import annotations


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as a signed-free uint32."""
    length = len(data)
    m, r = 0x5BD1E995, 24
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = length % 4
    base = length - tail
    if tail >= 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for_key(key: bytes, partitions: int) -> int:
    """The partition the Java client (and aiokafka's DefaultPartitioner) picks for ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
