"""Typed, versioned messages that cross the bus, and their orjson codec.

Every record on a lockgate topic is one JSON object ``{"v": <schema>, "type": <kind>, ...fields}``.
The classes here are the only shapes that travel; nothing else crosses a module boundary as a bare
dict. This module is pure (no asyncio, no Kafka, no torch) so every actor and test can use it.

Decoding untrusted bytes raises :class:`DecodeError` (a ``ValueError``) naming what was wrong;
consumers turn that into a dead-letter record and keep consuming.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

import orjson

from bus.codec import DecodeError, build

SCHEMA_VERSION = 1


class Tier(IntEnum):
    """Priority tier. Lower value = more urgent; the value is the tier's rank."""

    P0 = 0  # interactive, premium
    P1 = 1  # interactive, standard
    P2 = 2  # batch / background


class FinishReason:
    STOP = "stop"  # EOS, stop string or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the operator

    ALL = (STOP, LENGTH, ABORT)


class ErrorCode:
    INVALID_REQUEST = "invalid_request"
    EXPIRED = "expired"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"
    CANCELLED = "cancelled"


def _check_int(name: str, value: int, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Validated on construction: bad values raise ``ValueError``
    naming the field and its limit.

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k. ``seed`` makes sampling
    reproducible (same seed, same prompt, same tokens). ``stop`` strings never appear in the output.
    ``logprobs`` asks for the top-n log-probabilities of each sampled position (0..20).

    Sampling controls (vLLM / OpenAI semantics; the default of each disables it): ``min_p``
    (0..1) drops tokens below ``min_p`` times the top token's probability; ``repetition_penalty``
    (> 0) divides positive logits / multiplies negative ones of tokens seen in prompt or output;
    ``presence_penalty`` / ``frequency_penalty`` (-2..2) subtract once per distinct output token /
    per occurrence; ``logit_bias`` is (token id, bias) pairs, bias in -100..100, at most 300 ids,
    each once; ``min_tokens`` (0..max_tokens) suppresses EOS and ``stop_token_ids`` until that
    many output tokens exist.

    Structured output (vLLM's names; at most one of them): ``guided_json`` a JSON schema (JSON
    text of an object), ``guided_json_object`` any JSON object, ``guided_regex`` a regular
    expression, ``guided_choice`` one of these strings, ``guided_grammar`` an EBNF grammar
    (xgrammar's dialect; the edge builds these for tool calls). Texts up to 64 KiB in all.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    guided_json: str | None = None
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None

    MAX_LOGPROBS = 20
    MAX_STOP_STRINGS = 16
    MAX_LOGIT_BIAS = 300  # token ids in logit_bias (OpenAI's limit)
    MAX_BIAS = 100.0  # |bias| per token, as OpenAI
    MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI
    MAX_GUIDED_CHARS = 65536  # a guided_* text (schema, regex, grammar; choices together)
    MAX_GUIDED_CHOICES = 256

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=1)
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, (tuple, list)):
            raise ValueError(f"stop must be a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings, at most {self.MAX_STOP_STRINGS} allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError("stop_token_ids must be a list of integers")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=self.MAX_LOGPROBS)
        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            penalties[name] = value = _check_float(name, getattr(self, name))
            if not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}], got {value}")
        logit_bias = self._checked_bias()
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # Normalise lists (from JSON) to tuples so the value stays hashable and frozen.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "repetition_penalty", repetition_penalty)
        for name, value in penalties.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "logit_bias", logit_bias)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_guided()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def guided(self) -> bool:
        """True when one of the structured-output fields is set."""
        return self.guided_json_object or any(
            v is not None for v in (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar))

    def _check_guided(self) -> None:
        if not isinstance(self.guided_json_object, bool):
            raise ValueError("guided_json_object must be a boolean")
        given = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, n) is not None] + (["guided_json_object"] if self.guided_json_object else [])
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} cannot be combined: give at most one guided_* constraint")
        for name in ("guided_json", "guided_regex", "guided_grammar"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string")
            if len(v) > self.MAX_GUIDED_CHARS:
                raise ValueError(f"{name} is longer than {self.MAX_GUIDED_CHARS} characters")
        if self.guided_json is not None:
            try:
                schema = orjson.loads(self.guided_json)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"guided_json is not valid JSON: {str(exc)[:200]}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("guided_json must be a JSON schema (an object)")
        choices = self.guided_choice
        if choices is not None:
            if isinstance(choices, (str, bytes)) or not isinstance(choices, (tuple, list)) or not choices:
                raise ValueError("guided_choice must be a non-empty list of strings")
            if len(choices) > self.MAX_GUIDED_CHOICES:
                raise ValueError(f"guided_choice has {len(choices)} strings, at most {self.MAX_GUIDED_CHOICES} allowed")
            if not all(isinstance(c, str) and c for c in choices):
                raise ValueError("guided_choice must contain non-empty strings")
            if sum(len(c) for c in choices) > self.MAX_GUIDED_CHARS:
                raise ValueError(f"guided_choice is longer than {self.MAX_GUIDED_CHARS} characters in all")
            object.__setattr__(self, "guided_choice", tuple(choices))

    def seeded(self) -> SamplingParams:
        """These parameters with a seed: unchanged when one is set, else with a random one in the
        wire's range. Whoever puts a request on the bus (the edge, every producer) calls this, so
        each request on Kafka names its seed and any worker that re-runs or resumes it draws the
        same tokens."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))

    def _checked_bias(self) -> tuple[tuple[int, float], ...]:
        bias = self.logit_bias
        if not isinstance(bias, (tuple, list)):
            raise ValueError(f"logit_bias must be a list of [token_id, bias] pairs, got {type(bias).__name__}")
        if len(bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} token ids, at most {self.MAX_LOGIT_BIAS} allowed")
        out: list[tuple[int, float]] = []
        seen: set[int] = set()
        for pair in bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must contain [token_id, bias] pairs, got {pair!r}")
            tok, value = pair
            _check_int("logit_bias token id", tok, lo=0)
            if tok in seen:
                raise ValueError(f"logit_bias has token id {tok} more than once")
            seen.add(tok)
            value = _check_float(f"logit_bias[{tok}]", value)
            if not -self.MAX_BIAS <= value <= self.MAX_BIAS:
                raise ValueError(f"logit_bias[{tok}] must be in [-{self.MAX_BIAS:g}, {self.MAX_BIAS:g}], got {value}")
            out.append((tok, value))
        return tuple(out)


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

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        weight = _check_float("weight", self.weight)
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {self.weight}")
        object.__setattr__(self, "weight", weight)
        if not isinstance(self.reply_to, str) or not self.reply_to:
            raise ValueError("reply_to must be a non-empty topic name")
        _check_int("tier", self.tier, lo=min(Tier), hi=max(Tier))
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


Message = InferenceRequest | TokenChunk | Finished | Error | Cancel | WorkerStatus | ReplyBatch | UsageRecord

_TYPE_NAMES: dict[type, str] = {
    InferenceRequest: "request",
    TokenChunk: "chunk",
    Finished: "finished",
    Error: "error",
    Cancel: "cancel",
    WorkerStatus: "status",
    ReplyBatch: "replies",
    UsageRecord: "usage",
}
_BY_NAME: dict[str, type] = {v: k for k, v in _TYPE_NAMES.items()}


def encode(msg: Message) -> bytes:
    """Serialise a message to one JSON object with its schema version and type tag."""
    kind = _TYPE_NAMES.get(type(msg))
    if kind is None:
        raise TypeError(f"not a bus message: {type(msg).__name__}")
    body = orjson.dumps(msg)  # orjson serialises (slotted) dataclasses natively
    # Every message has at least one field, so ``body`` is ``{"...`` and splicing is safe.
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
    if version != SCHEMA_VERSION:
        raise DecodeError(f"unsupported schema version {version!r} (this build reads {SCHEMA_VERSION})")
    kind = obj.pop("type", None)
    cls = _BY_NAME.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DecodeError(f"unknown message type {kind!r}")
    try:
        return build(cls, obj, kind)
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
