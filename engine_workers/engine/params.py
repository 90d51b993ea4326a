"""What the engine is asked to do for one sequence, and why a sequence stopped.

The engine's own types, not the bus's: the engine runs with no bus at all (``lockgate generate``,
the benchmarks), so it owns its vocabulary and the worker converts the wire request into it
(``engine_workers.worker.convert``). Values from users are validated where they enter (the wire
codec, the CLI); the checks here guard the engine's own invariants and name the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class FinishReason:
    STOP = "stop"  # EOS, stop string or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the operator

    ALL = (STOP, LENGTH, ABORT)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` disables top-k; ``seed`` makes sampling
    reproducible; ``stop`` strings never appear in the output; ``logprobs`` asks for the top-n
    log-probabilities of each sampled position."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
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
        # Lists (from JSON or a caller) become tuples so the value stays hashable and frozen.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
