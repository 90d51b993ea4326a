"""How to sample one request, and why a sequence stopped: one definition from the bus record to
the sampler. The edge or a producer builds it, the bus record carries it (``bus.messages``), the
worker hands the decoded value to the engine as it is, and the sampler reads it.

Validated once, on construction, field by field: a bad value raises ``ValueError`` naming the field
and its limit, whoever built it (the wire decoder, the CLI, a test). Pure (no torch, no I/O); the
check helpers serve every wire type too.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import orjson


class FinishReason:
    STOP = "stop"  # EOS, stop string or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the operator

    ALL = (STOP, LENGTH, ABORT)


LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, ids ascending and unique


def check_int(name: str, value: int, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def check_float(name: str, value: float) -> float:
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
    per occurrence; ``logit_bias`` is (token id, bias) pairs (or a mapping), bias in -100..100, at
    most 300 ids, each once, stored sorted by id; ``min_tokens`` (0..max_tokens) suppresses EOS and ``stop_token_ids`` until that
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
    logit_bias: LogitBias = ()
    min_tokens: int = 0
    guided_json: str | None = None
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None
    # An embedding request: no token is sampled; the prompt's prefill ends the request and its
    # Finished carries the pooled, L2-normalised final hidden state: "last" (the last prompt
    # token's) or "mean" (the mean over every prompt token's; such a request skips the prefix-cache
    # lookup, rows it did not compute could not be summed: uses_prefix_cache); see docs/design.md,
    # "Embeddings".
    pooling: str | None = None

    MAX_LOGPROBS = 20
    MAX_STOP_STRINGS = 16
    MAX_LOGIT_BIAS = 300  # token ids in logit_bias (OpenAI's limit)
    MAX_BIAS = 100.0  # |bias| per token, as OpenAI
    MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI
    MAX_GUIDED_CHARS = 65536  # a guided_* text (schema, regex, grammar; choices together)
    MAX_GUIDED_CHOICES = 256
    POOLINGS = ("last", "mean")

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, lo=1)
        temperature = check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        top_p = check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, lo=0)
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=2**63 - 1)
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
            check_int("stop_token_ids[]", t, lo=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, lo=0, hi=self.MAX_LOGPROBS)
        min_p = check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        repetition_penalty = check_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            penalties[name] = value = check_float(name, getattr(self, name))
            if not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}], got {value}")
        logit_bias = self._checked_bias()
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.pooling is not None and self.pooling not in self.POOLINGS:
            raise ValueError(f"pooling must be 'last' or 'mean' (or None), got {self.pooling!r}")
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
    def penalised(self) -> bool:
        """True when a repetition, presence or frequency penalty applies (the sampler then needs
        the sequence's token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request may start from cached prefix blocks: not a mean-pooled one, whose
        vector sums the final states of every prompt row, cached or not."""
        return self.pooling != "mean"

    @property
    def guided(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's output constraint, or ``None`` (so it is truthy exactly
        when one guided_* field is set): the key the engine's grammar cache compiles (kinds
        ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``)."""
        if self.guided_json is not None:
            return ("json", self.guided_json)
        if self.guided_json_object:
            return ("json_object", "")
        if self.guided_regex is not None:
            return ("regex", self.guided_regex)
        if self.guided_choice is not None:
            return ("choice", json.dumps(list(self.guided_choice)))
        if self.guided_grammar is not None:
            return ("grammar", self.guided_grammar)
        return None

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

    def _checked_bias(self) -> LogitBias:
        bias: Mapping[int, float] | Iterable[tuple[int, float]] = self.logit_bias
        if isinstance(bias, Mapping):
            bias = list(bias.items())
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
            check_int("logit_bias token id", tok, lo=0)
            if tok in seen:
                raise ValueError(f"logit_bias has token id {tok} more than once")
            seen.add(tok)
            value = check_float(f"logit_bias[{tok}]", value)
            if not -self.MAX_BIAS <= value <= self.MAX_BIAS:
                raise ValueError(f"logit_bias[{tok}] must be in [-{self.MAX_BIAS:g}, {self.MAX_BIAS:g}], got {value}")
            out.append((tok, value))
        # Sorted so equal biases give equal (hashable, comparable) params whatever order they came in.
        return tuple(sorted(out))
