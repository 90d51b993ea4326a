"""What the engine hands out: a step's per-request delta (:class:`RequestOutput`), a finished
offline request (:class:`CompletedRequest`, from ``Engine.generate``) and the running counters
(:class:`EngineStats`). Plain values, so the worker's reply path and spans import them without the
engine's machinery."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_workers.engine.sampler import TokenLogprobs
from engine_workers.engine.sequence import SeqTimes


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (a delta). ``seq`` is the output index of
    ``token_ids[0]``; ``text_offset`` the number of output characters before ``text``."""

    request_id: str
    seq: int
    token_ids: tuple[int, ...]
    text: str
    text_offset: int
    logprobs: tuple[TokenLogprobs, ...] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    times: SeqTimes | None = None  # set on the final output
    seed: int | None = None  # the seed the request's draws use (its own or the engine's pick)
    embedding: tuple[float, ...] | None = None  # a pooling request's vector (on its final output)


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    num_cached_tokens: int
    seed: int | None = None  # the seed the draws used (the request's own or the engine's pick)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_tokens: int = 0  # tokens run through the model (prefill + decode + recompute)
    generated_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    last_batch_tokens: int = 0
    last_batch_seqs: int = 0
    busy_s: float = 0.0  # wall seconds inside the steps that ran a batch (scheduling to the last output)
    # speculative decoding (vLLM's spec_decode_* counters): verification chunks run, tokens they
    # proposed, and of those the tokens accepted (the token each draft adds at its first
    # disagreement, or after its last accepted token, is not counted)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
