"""A request's state inside the engine. Pure (no torch): the scheduler and the engine share it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lockgate_types import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SeqTimes:
    """``time.monotonic()`` stamps; ``arrival`` may come from outside (queue time before the engine)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutable by the engine's step loop only.

    Invariant: ``num_computed_tokens <= num_tokens``; the K/V of the first ``num_computed_tokens``
    tokens of ``all_token_ids`` are in this sequence's blocks.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: float = 0.0
    cache_extra: bytes = b""
    lora: str | None = None  # the LoRA adapter's name (engine_workers.model.lora); None = the base model
    times: SeqTimes = field(default_factory=lambda: SeqTimes(0.0))
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    admit_order: int = -1  # set at each admission; newest = largest (preemption victim choice)
    arrival_order: int = -1  # set once; FIFO tie-break among equal priorities
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of num_preemptions, those for a more urgent request
    # its tier's time-per-output-token target (the worker's SLO); the scheduler sizes each step so
    # the strictest target among the running decodes holds (None: no target)
    tpot_slo_s: float | None = None
    # its tier (the worker's), what priority preemption compares; None: the priority is compared
    tier: int | None = None
    finish_reason: str | None = None
    # The seed the sampler's counter-based draws use (the request's own, or one the engine drew at
    # add_request): the draw for output position k depends only on (seed, k), see engine.sampler.
    seed: int = 0
    # Speculative decoding: tokens proposed to follow this decoding sequence (engine.core sets
    # them before each schedule; the scheduler runs them as extra positions when they fit).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
