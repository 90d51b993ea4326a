"""Typed, versioned messages that cross the bus, and their orjson codec.

Every record on a lockgate topic is one JSON object ``{"v": <schema>, "type": <kind>, ...fields}``
(plus ``"must": [...]`` when it sets a must-understand field); how the schema evolves, so old and
new workers and edges share a topic, is :mod:`bus.evolution` (docs/bus.md, "Record evolution").
The classes here are the only shapes that travel; nothing else crosses a module boundary as a bare
dict. This module is pure (no asyncio, no Kafka, no torch) so every actor and test can use it.

Decoding untrusted bytes raises :class:`DecodeError` (a ``ValueError``) naming what was wrong;
consumers turn that into a dead-letter record and keep consuming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import orjson

from bus.codec import DecodeError, build
from bus.evolution import SCHEMA_VERSION, check_version, lenient_body, must_list
from lockgate_types import FinishReason as FinishReason  # re-exported: the wire names it too
from lockgate_types import SamplingParams, check_float, check_int
from lockgate_types.evolution import must_understand


class Tier(IntEnum):
    """Priority tier. Lower value = more urgent; the value is the tier's rank."""

    P0 = 0  # interactive, premium
    P1 = 1  # interactive, standard
    P2 = 2  # batch / background


class ErrorCode:
    INVALID_REQUEST = "invalid_request"
    EXPIRED = "expired"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


MIN_WEIGHT = 0.01  # fair-share weights (InferenceRequest.weight, the edge key file's ``weight``)
MAX_WEIGHT = 1000.0


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One generation request on a priority topic. ``prompt_token_ids`` is authoritative (the
    edge tokenizes); ``prompt_text``/``messages`` are kept for logs and replay.

    ``attempt`` counts re-publications (replay, retries); workers echo it in every reply so a
    reply consumer can tell streams apart. Times are UNIX seconds.
    """

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    reply_to: str
    tenant: str = "anonymous"
    tier: int = Tier.P1
    enqueued_at: float = 0.0
    deadline: float | None = None
    prompt_text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    cache_salt: str | None = None
    attempt: int = 0
    # The tenant's fair-share weight within its tier (edge key file ``weight``; docs/worker.md,
    # "Fair share"): a tenant of weight 2 gets twice the tokens of a tenant of weight 1 when both wait.
    weight: float = 1.0
    # Revision 2: the LoRA adapter (its served name) the worker must run the request with; None =
    # the base model. Must-understand: a worker without adapters refuses it rather than silently
    # serving the base model (docs/bus.md, "Record evolution"; docs/lora.md).
    lora: str | None = field(default=None, metadata=must_understand())
    # Revision 2: where the adapter ``lora`` was loaded from at run time (POST /v1/load_lora_adapter,
    # docs/lora.md): a worker that lacks it loads it from there before running the request (a worker
    # started after the load, or one re-running the request after a crash). Only a hint: a worker
    # that ignores it answers ``invalid_request`` for an adapter it lacks, never the base model.
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError("lora must be a non-empty adapter name or null")
        if self.lora_path is not None and (self.lora is None or not isinstance(self.lora_path, str)
                                           or not self.lora_path):
            raise ValueError("lora_path must be a non-empty folder, and only with lora")
        weight = check_float("weight", self.weight)
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {self.weight}")
        object.__setattr__(self, "weight", weight)
        if not isinstance(self.reply_to, str) or not self.reply_to:
            raise ValueError("reply_to must be a non-empty topic name")
        check_int("tier", self.tier, lo=min(Tier), hi=max(Tier))
        if not isinstance(self.prompt_token_ids, (tuple, list)) or not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(self.messages))


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens of one request produced in one engine step, in order.

    ``seq`` is the output index of ``token_ids[0]``; ``text_offset`` is the number of output
    characters before ``text``. A consumer keeps the next index it expects and drops what it
    already has, so a re-run after a worker crash (same tokens, deterministic) shows up once.
    """

    request_id: str
    attempt: int
    seq: int
    token_ids: tuple[int, ...]
    text: str
    text_offset: int
    logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None  # per token: top-n (id, logprob)
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds. ``queue`` = enqueue to first schedule; ``ttft`` = enqueue to first token;
    ``tpot`` = mean time per output token after the first; ``e2e`` = enqueue to finish."""

    queue: float = 0.0
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    attempt: int
    finish_reason: str
    num_tokens: int  # total output tokens; also the seq after the last chunk
    usage: Usage
    timings: Timings = field(default_factory=Timings)
    worker_id: str = ""
    embedding: tuple[float, ...] | None = None  # a pooling request's vector (SamplingParams.pooling)


@dataclass(frozen=True, slots=True)
class Error:
    request_id: str
    code: str
    message: str
    attempt: int = 0
    retry_after: float | None = None
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str
    reason: str = "client"


@dataclass(frozen=True, slots=True)
class PartitionHold:
    """One request partition a worker owns and the record time (UNIX ms, the broker's time index)
    from which every record it has not answered lies: its oldest request in flight, or the time of
    the heartbeat when none is."""

    topic: str
    partition: int
    since_ms: int


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """Heartbeat. ``queue_depth[t]`` / ``est_wait_s[t]`` are per tier (index = tier rank)."""

    worker_id: str
    model: str
    ts: float
    queue_depth: tuple[int, ...] = (0, 0, 0)
    est_wait_s: tuple[float, ...] = (0.0, 0.0, 0.0)
    running: int = 0
    max_num_seqs: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    tokens_per_s: float = 0.0
    draining: bool = False
    # Records per tier still on the topic in this worker's partitions (consumer lag), and how many
    # partitions it owns: the edge weighs each worker's wait by the share of requests it gets.
    lag: tuple[int, ...] = (0, 0, 0)
    partitions: int = 0
    # Revision 2: the LoRA adapters this worker serves (docs/lora.md); the edge lists them in
    # /v1/models and routes a request naming one to this model's topics
    loras: tuple[str, ...] = ()
    # Revision 2 too: failover (docs/worker.md, "Failover"): per owned request partition, where a survivor must
    # start reading to find every request not yet answered here; the request ids this worker runs
    # as a takeover of a dead peer (claims: nobody else runs them while they are listed); the
    # numerics fingerprint (precision, ISA, kernels): a takeover is exact only between equal ones.
    holds: tuple[PartitionHold, ...] = ()
    taken: tuple[str, ...] = ()
    numerics: str = ""


@dataclass(frozen=True, slots=True)
class ReplyBatch:
    """Replies to several requests in one record: what a worker has for one partition of one reply
    topic after a step (one record per step instead of one per running request).

    Order: a request appears at most once in ``chunks`` and at most once among ``finished`` and
    ``errors``, and its chunk precedes its final reply. A consumer handles ``chunks`` in order, then
    ``finished``, then ``errors`` (:func:`replies_of` does exactly that), which is the order the
    records would have had one by one. Every request in the batch has this record's partition, the
    one its own key (the request id) maps to, so a request's replies stay in one partition, in order.
    """

    chunks: tuple[TokenChunk, ...] = ()
    finished: tuple[Finished, ...] = ()
    errors: tuple[Error, ...] = ()


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request's usage, for billing: the worker sends one to ``<ns>.usage``
    (``TopicLayout.usage_topic``, keyed by tenant) after the request's final reply was acknowledged.
    ``finished_at`` is UNIX seconds. At-least-once: a request re-run after a crash or a send failure
    may be recorded again; deduplicate by ``request_id`` (and ``attempt``)."""

    request_id: str
    tenant: str
    model: str
    tier: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_at: float
    finish_reason: str
    attempt: int = 0
    worker_id: str = ""
    lora: str | None = None  # revision 2: the LoRA adapter the request ran with (None: the base model)


LORA_ACTIONS = ("load", "unload")


@dataclass(frozen=True, slots=True)
class LoraControl:
    """Load or unload LoRA adapter ``lora_name`` on every worker of ``model``, at run time (vLLM's
    ``/v1/load_lora_adapter`` / ``unload_lora_adapter``, docs/lora.md). Broadcast on the control
    topic (every worker reads all of it); each worker of ``model`` answers one :class:`LoraAck` on
    ``reply_to``, keyed by ``op_id``. ``lora_path`` is the PEFT folder as the workers see it (load only)."""

    op_id: str
    model: str
    action: str
    lora_name: str
    reply_to: str
    lora_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("op_id", "model", "lora_name", "reply_to"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string")
        if self.action not in LORA_ACTIONS:
            raise ValueError(f"action must be one of {LORA_ACTIONS}, got {self.action!r}")
        if self.action == "load" and (not isinstance(self.lora_path, str) or not self.lora_path):
            raise ValueError("a load needs lora_path, the adapter's folder")


@dataclass(frozen=True, slots=True)
class LoraAck:
    """One worker's answer to a :class:`LoraControl` (on the control's ``reply_to``). ``ok`` False:
    ``code`` (an :class:`ErrorCode`) and ``message`` say what was wrong (a missing folder, a
    malformed config, an adapter of another model, LoRA off on that worker)."""

    op_id: str
    worker_id: str
    ok: bool
    code: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class KeyLoad:
    """One API key's load at one edge, in an :class:`EdgeStatus`: ``key`` is a prefix of the key's
    SHA-256 hex (never the key), ``demand`` the requests it attempted per second (admitted or
    refused, decayed over seconds), ``streams`` its streams in flight, ``stream_demand`` those plus
    its recent ``max_streams`` refusals (decayed), ``claim`` the streams it reserves (never below
    ``streams``)."""

    key: str
    demand: float = 0.0
    streams: int = 0
    stream_demand: float = 0.0
    claim: int = 0  # the most streams of the key this edge may hold (its part of max_streams)


@dataclass(frozen=True, slots=True)
class EdgeStatus:
    """An edge's heartbeat on ``<ns>.edges`` (``TopicLayout.edges_topic``): what every edge reads to
    split each key's limits over the live edges (edge/admission/fleet.py, docs/protocol.md,
    "Fleet-wide limits"). ``gone``: the edge is stopping, its share is free at once. ``keys``: the
    keys with load at this edge or at another; a key left out has none here and its even share of
    ``max_streams`` among ``members`` reserved. ``members``: the edges this one counts, itself included
    (empty before it has read its own heartbeat back: it reserves nothing then)."""

    edge_id: str
    ts: float
    seq: int = 0
    gone: bool = False
    keys: tuple[KeyLoad, ...] = ()
    members: tuple[str, ...] = ()


Message = (InferenceRequest | TokenChunk | Finished | Error | Cancel | WorkerStatus | ReplyBatch | UsageRecord
           | LoraControl | LoraAck | EdgeStatus)

_TYPE_NAMES: dict[type, str] = {
    InferenceRequest: "request",
    TokenChunk: "chunk",
    Finished: "finished",
    Error: "error",
    Cancel: "cancel",
    WorkerStatus: "status",
    ReplyBatch: "replies",
    UsageRecord: "usage",
    LoraControl: "lora_control",
    LoraAck: "lora_ack",
    EdgeStatus: "edge",
}
_BY_NAME: dict[str, type] = {v: k for k, v in _TYPE_NAMES.items()}


def encode(msg: Message) -> bytes:
    """Serialise a message to one JSON object with its schema version and type tag."""
    kind = _TYPE_NAMES.get(type(msg))
    if kind is None:
        raise TypeError(f"not a bus message: {type(msg).__name__}")
    body = orjson.dumps(msg)  # orjson serialises (slotted) dataclasses natively
    # Every message has at least one field, so ``body`` is ``{"...`` and splicing is safe.
    must = must_list(msg)
    if must:
        return b'{"v":%d,"type":"%s","must":%s,%s' % (SCHEMA_VERSION, kind.encode(), orjson.dumps(must), body[1:])
    return b'{"v":%d,"type":"%s",%s' % (SCHEMA_VERSION, kind.encode(), body[1:])


def decode(data: bytes | bytearray | memoryview | str) -> Message:
    """Parse one record. Raises :class:`DecodeError` naming the problem; never anything else."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a JSON object, got {type(obj).__name__}")
    version = obj.pop("v", None)
    check_version(version)
    must = obj.pop("must", None)
    kind = obj.pop("type", None)
    cls = _BY_NAME.get(kind) if isinstance(kind, str) else None
    if cls is None:
        # a newer writer's new record type: refused here too (dead-lettered), like any unknown type
        raise DecodeError(f"unknown message type {kind!r}")
    lenient = lenient_body(version, must, cls, kind)
    try:
        return build(cls, obj, kind, lenient)
    except DecodeError:
        raise
    except (ValueError, TypeError) as exc:
        raise DecodeError(f"invalid {kind}: {exc}") from None


def replies_of(msg: Message) -> tuple[Message, ...]:
    """The replies a decoded record carries, in order: a :class:`ReplyBatch`'s chunks, then its
    finished, then its errors; any other message alone. Every reply-topic consumer goes through
    this, so it reads batched and single records alike."""
    if msg.__class__ is ReplyBatch:
        return msg.chunks + msg.finished + msg.errors
    return (msg,)


def decode_as(cls: type, data: bytes) -> Any:
    """Decode and check the type; a record of another kind raises :class:`DecodeError`."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise DecodeError(f"expected {_TYPE_NAMES[cls]}, got {_TYPE_NAMES[type(msg)]}")
    return msg
