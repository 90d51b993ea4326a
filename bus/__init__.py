"""The lockgate bus: typed messages over Kafka or an in-memory broker with the same semantics.

``connect(url)`` returns a (not yet started) :class:`Bus`:

* ``memory://``               a private in-process broker;
* ``memory://<name>``         the process-wide broker called ``name`` (edge + workers in one process);
* ``kafka://host:port[,host:port...]``  Apache Kafka through aiokafka.

Options come from the query string or keyword arguments (keywords win), e.g.
``kafka://127.0.0.1:9092?client_id=edge-1&connect_timeout_s=5`` or
``memory://demo?default_partitions=6``. Unknown options raise ``ValueError``.
Kafka TLS/SASL (``security_protocol``, ``sasl_mechanism``, ``sasl_username``, ``ssl_cafile``, ...)
come from the same query, keywords, or ``LOCKGATE_KAFKA_*`` environment variables; the password
only from the environment or a file (:mod:`bus.kafka.security`).
aiokafka is imported only when a Kafka bus is created.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from bus.base import (
    Bus,
    BusError,
    Consumer,
    RebalanceCallback,
    Record,
    RecordMetadata,
    StartFrom,
    TopicPartition,
    TopicSpec,
    UnknownTopicError,
    checked_topic_names,
)
from bus.blobs import BlobRef, BlobStore
from bus.deadletter import DeadLetter, DeadLetterer, decode_or_deadletter, parse_dead_letter, read_dead_letters, send_dead_letter
from bus.logcontext import REQUEST_ID, TRACE_ID, bound
from bus.memory import MemoryBroker, MemoryBus, forget_named, named_broker
from bus.messages import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    SCHEMA_VERSION,
    Cancel,
    ChatMessage,
    DecodeError,
    EdgeStatus,
    Error,
    ErrorCode,
    Finished,
    FinishReason,
    InferenceRequest,
    KeyLoad,
    LoraAck,
    LoraControl,
    Message,
    PartitionHold,
    ReplyBatch,
    SamplingParams,
    Tier,
    Timings,
    TokenChunk,
    Usage,
    UsageRecord,
    WorkerStatus,
    decode,
    encode,
    replies_of,
)
from bus.partitioner import murmur2, partition_for_key
from bus.table import CompactedTable
from bus.topics import TopicLayout, safe_name
from bus.window import parse_time_ms, read_time_window

# The facade: code outside bus/ imports from here only (an import-linter contract in pyproject.toml),
# so the modules behind it can move without touching their callers.
__all__ = [
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "REQUEST_ID",
    "SCHEMA_VERSION",
    "TRACE_ID",
    "BlobRef",
    "BlobStore",
    "Bus",
    "BusError",
    "Cancel",
    "ChatMessage",
    "CompactedTable",
    "Consumer",
    "DeadLetter",
    "DeadLetterer",
    "DecodeError",
    "EdgeStatus",
    "Error",
    "ErrorCode",
    "FinishReason",
    "Finished",
    "InferenceRequest",
    "KeyLoad",
    "LoraAck",
    "LoraControl",
    "MemoryBroker",
    "MemoryBus",
    "Message",
    "RebalanceCallback",
    "Record",
    "RecordMetadata",
    "PartitionHold",
    "ReplyBatch",
    "SamplingParams",
    "StartFrom",
    "Tier",
    "Timings",
    "TokenChunk",
    "TopicLayout",
    "TopicPartition",
    "TopicSpec",
    "UnknownTopicError",
    "Usage",
    "UsageRecord",
    "WorkerStatus",
    "bound",
    "checked_topic_names",
    "connect",
    "decode",
    "decode_or_deadletter",
    "encode",
    "forget_named",
    "kafka_bootstrap",
    "murmur2",
    "named_broker",
    "parse_dead_letter",
    "parse_time_ms",
    "partition_for_key",
    "read_dead_letters",
    "read_time_window",
    "replies_of",
    "safe_name",
    "send_dead_letter",
]

_MEMORY_OPTIONS = {"default_partitions": int, "max_records_per_partition": int, "retention_ms": int}
_KAFKA_OPTIONS = {
    "client_id": str,
    "connect_timeout_s": float,
    "request_timeout_ms": int,
    "linger_ms": int,
    "session_timeout_ms": int,
    "fetch_max_wait_ms": int,
    "heartbeat_interval_ms": int,
    "assignment_timeout_s": float,
    "default_partitions": int,
    "max_request_size": int,
}


def _options(url: str, query: str, allowed: Mapping[str, type], kwargs: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in allowed:
            raise ValueError(f"{url}: unknown option {name!r} (known: {', '.join(sorted(allowed))})")
        try:
            opts[name] = allowed[name](raw)
        except ValueError:
            raise ValueError(f"{url}: option {name}={raw!r} is not a valid {allowed[name].__name__}") from None
    for name, value in kwargs.items():
        if name not in allowed:
            raise ValueError(f"{url}: unknown option {name!r} (known: {', '.join(sorted(allowed))})")
        opts[name] = value
    return opts


def kafka_bootstrap(url: str) -> list[tuple[str, int]]:
    """The (host, port) bootstrap addresses of a ``kafka://host:port[,host:port]`` URL, in order.
    Raises ``ValueError`` naming the address that is not ``host:port``."""
    hosts = [h.strip() for h in urlsplit(url).netloc.split(",") if h.strip()]
    if not hosts:
        raise ValueError(f"{url}: no bootstrap address; use kafka://host:port[,host:port]")
    out = []
    for h in hosts:
        host, sep, port = h.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{url}: bootstrap address {h!r} is not host:port")
        out.append((host, int(port)))
    return out


def _redacted(url: str) -> str:
    """``url`` with its query cut off (it may hold a password that must not be echoed)."""
    return url.split("?", 1)[0] + "?..." if "?" in url else url


def connect(url: str, **kwargs: Any) -> Bus:
    """A bus for ``url`` (see the module docstring). Call ``start()`` or use ``async with``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        opts = _options(url, parts.query, _MEMORY_OPTIONS, kwargs)
        name = (parts.netloc + parts.path).strip("/")
        broker = named_broker(name, **opts) if name else MemoryBroker(**opts)
        return MemoryBus(url, broker)
    if scheme == "kafka":
        from bus.kafka import KafkaBus  # aiokafka is heavy: import only when used
        from bus.kafka.security import SECRET_OPTIONS, URL_OPTIONS, security_from

        if any(name in SECRET_OPTIONS for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
            raise ValueError(f"{_redacted(url)}: sasl_password is not accepted in the bus URL (URLs show in "
                             "process lists and logs); set LOCKGATE_KAFKA_SASL_PASSWORD or sasl_password_file")
        secret = {k: kwargs.pop(k) for k in SECRET_OPTIONS if k in kwargs}
        opts = _options(url, parts.query, {**_KAFKA_OPTIONS, **URL_OPTIONS}, kwargs)
        hosts = kafka_bootstrap(url)
        security = security_from({**{k: opts.pop(k) for k in list(opts) if k in URL_OPTIONS}, **secret}, os.environ)
        return KafkaBus(",".join(f"{h}:{p}" for h, p in hosts), url=url, security=security, **opts)
    raise ValueError(f"unsupported bus URL {url!r}: use memory://[name] or kafka://host:port[,host:port]")
