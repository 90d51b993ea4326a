"""What the engine is asked to do for one sequence, and why a sequence stopped.

The engine's own types, not the bus's: the engine runs with no bus at all (``lockgate generate``,
the benchmarks), so it owns its vocabulary and the worker converts the wire request into it
(``engine_workers.worker.convert``). Values from users are validated where they enter (the wire
codec, the CLI); the checks here guard the engine's own invariants and name the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class FinishReason:
    STOP = "stop"  # EOS, stop string or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the operator

    ALL = (STOP, LENGTH, ABORT)


LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, ids ascending and unique


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` disables top-k; ``seed`` makes sampling
    reproducible; ``stop`` strings never appear in the output; ``logprobs`` asks for the top-n
    log-probabilities of each sampled position.

    Sampling controls (vLLM / OpenAI semantics; the neutral value of each disables it):
    ``min_p`` drops tokens below ``min_p`` times the most likely token's probability;
    ``repetition_penalty`` divides positive logits (multiplies negative ones) of every token seen in
    the prompt or the output; ``presence_penalty`` / ``frequency_penalty`` subtract once per distinct
    output token / once per occurrence; ``logit_bias`` adds a bias to chosen tokens' logits (a
    mapping or (id, bias) pairs; stored as sorted pairs); ``min_tokens`` suppresses EOS and
    ``stop_token_ids`` until that many output tokens exist.
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
    # Structured output (vLLM's names; at most one): a JSON schema (JSON text), any JSON object, a
    # regular expression, one of some strings, or an EBNF grammar (xgrammar's dialect). See
    # engine.guided; ``guided`` is the (kind, text) the grammar cache compiles.
    guided_json: str | None = None
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None
    # embedding: the prefill ends the request with a normalised final hidden state
    # (RequestOutput.embedding) instead of a sampled token: "last", the last prompt row's, or
    # "mean", the mean of every prompt row's (so the request never adopts a cached prefix: rows it
    # did not compute could not be summed; see uses_prefix_cache)
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean' (or None), got {self.pooling!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, (str, bytes)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        # Lists (from JSON or a caller) become tuples so the value stays hashable and frozen.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.guided_choice is not None:
            object.__setattr__(self, "guided_choice", tuple(self.guided_choice))
        _check_guided(self)

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request may start from cached prefix blocks: not a mean-pooled one, whose
        vector sums the final states of every prompt row, cached or not."""
        return self.pooling != "mean"

    @property
    def guided(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's output constraint, or ``None``: the key the engine's
        grammar cache compiles (kinds ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``)."""
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """True when a repetition, presence or frequency penalty applies (the sampler then needs
        the sequence's token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_guided(p: SamplingParams) -> None:
    given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(p, name) is not None] + (["guided_json_object"] if p.guided_json_object else [])
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} cannot be combined: give at most one guided_* constraint")
    for name in ("guided_json", "guided_regex", "guided_grammar"):
        v = getattr(p, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"{name} must be a non-empty string")
    if p.guided_choice is not None and (not p.guided_choice or not all(isinstance(c, str) and c for c in p.guided_choice)):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")


def _normalise_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> LogitBias:
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"logit_bias must map token ids to biases, got entry {pair!r}")
        tok, val = pair
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {tok!r}")
        if tok in out:
            raise ValueError(f"logit_bias has token id {tok} more than once")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise ValueError(f"logit_bias[{tok}] must be a finite number, got {val!r}")
        out[tok] = float(val)
    # Sorted so equal biases give equal (hashable, comparable) params whatever order they came in.
    return tuple(sorted(out.items()))
