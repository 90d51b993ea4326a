"""``--speculative-config``: which proposer speculates and how far, parsed from vLLM's JSON object.

Three proposers exist: n-gram prompt lookup (:mod:`engine_workers.engine.ngram`), a draft model
(:mod:`engine_workers.engine.draft`, ``"method": "draft_model"`` with ``"model"``) and the
checkpoint's own MTP layers (:mod:`engine_workers.engine.mtp`, ``"method": "mtp"``); the EAGLE
and other methods vLLM also accepts are refused by name (not built yet). The keys are vLLM's:
``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``
and ``disable_by_batch_size``; a key lockgate does not implement is an error naming it, never
silently ignored. Cheap to import (json and dataclasses only): the CLI parses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# mtp / deepseek_mtp (vLLM's older name): the checkpoint's own MTP module (engine.mtp)
METHODS = ("ngram", "draft_model", "mtp", "deepseek_mtp")
# vLLM's other methods: refused with a message saying they are not built yet, not as unknown
_LATER = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")
# vLLM's default when neither prompt_lookup bound is given
DEFAULT_LOOKUP = 5
# lockgate's default for disable_by_batch_size (vLLM has none): on a CPU a verification pass costs
# k + 1 rows per sequence, which pays at small batches and not once the step is compute-bound
# (docs/design-history.md, Speculative decoding)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``num_speculative_tokens``: k, the most tokens proposed per request per step.
    ``prompt_lookup_min``/``max``: the n-gram lengths the proposer matches (longest first).
    ``disable_by_batch_size``: no request speculates in a step while more than this many
    sequences are running. ``model``: the draft model's checkpoint (``draft_model`` only: a
    folder, ``default`` or a hub id, as ``--model``), with the target's tokenizer."""

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            if self.method in _LATER:
                raise ValueError(f"speculative config: method {self.method!r} is not implemented yet; "
                                 f"available: {', '.join(METHODS)}")
            raise ValueError(f"speculative config: unknown method {self.method!r}; available: {', '.join(METHODS)}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError("speculative config: method 'draft_model' needs \"model\": the draft checkpoint")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative config: method {self.method!r} takes no \"model\" (got {self.model!r}); "
                             "a draft checkpoint needs \"method\": \"draft_model\"")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative config: {key} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """Parse the flag's JSON object; ``None`` for an empty value, ``null`` or ``{}`` (off)."""
        if text is None or not str(text).strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
        if raw is None or raw == {}:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(raw).__name__}: {text!r}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> SpeculativeConfig:
        """vLLM's rules: ``method`` defaults to ``draft_model`` when a ``model`` is given, else
        ``ngram``; one ``prompt_lookup_*`` bound given sets the other to it, neither gives both 5."""
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative config: unknown key {unknown[0]!r}; known keys: {', '.join(_KEYS)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative config: num_speculative_tokens is required")
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative config: model must be a string (a checkpoint), got {model!r}")
        method = raw.get("method", "ngram" if model is None else "draft_model")
        if not isinstance(method, str):
            raise ValueError(f"speculative config: method must be a string, got {method!r}")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None:
            lo = DEFAULT_LOOKUP if hi is None else hi
        if hi is None:
            hi = lo
        return cls(num_speculative_tokens=raw["num_speculative_tokens"], method=method.strip().lower(), model=model,
                   prompt_lookup_max=hi, prompt_lookup_min=lo,
                   disable_by_batch_size=raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE))


def batch_limit(k: int, running: int, disable_by_batch_size: int) -> int:
    """The longest draft while ``running`` sequences run: ``k`` alone, one token less per
    ``disable_by_batch_size / k`` more sequences, at least 1 (a CPU step turns compute-bound as the
    batch grows, and each proposal is a row of it); past ``disable_by_batch_size`` none run."""
    return max(1, k - (running - 1) * k // disable_by_batch_size)


# A draft with no accepted token makes its request sit out 2**m steps (m: such drafts in a row),
# at most this many; one accepted token resets it. Low acceptance thus costs few verification rows,
# and a request whose text starts quoting again speculates again soon.
MAX_BACKOFF_STEPS = 16


@dataclass(slots=True)
class SpecBackoff:
    """One request's speculation schedule (engine.core): the low-acceptance rules.

    Whether: after a draft of which nothing was accepted the request sits out a doubling number of
    steps. How far: a partly rejected draft of which ``a`` tokens were accepted makes the next one
    ``a + 1`` tokens long; a fully accepted draft doubles the length (up to ``k``, the config's);
    the draft after a sit-out probes with one token. Rows that would likely be rejected cost
    verification compute (each a row of the step's forward) for nothing."""

    misses: int = 0  # drafts in a row with no token accepted
    resume_step: int = 0  # the engine step from which the request may speculate again
    length: int | None = None  # the next draft's length (None: the config's k)

    def allows(self, step: int) -> bool:
        return step >= self.resume_step

    def limit(self, k: int) -> int:
        """The next draft's length, at most ``k``."""
        return k if self.length is None else max(1, min(k, self.length))

    def record(self, step: int, accepted: int, proposed: int | None = None) -> None:
        if accepted:
            self.misses, self.resume_step = 0, 0
            if proposed is not None:
                self.length = 2 * accepted if accepted >= proposed else accepted + 1
            return
        self.misses += 1
        self.resume_step = step + 1 + min(2 ** self.misses, MAX_BACKOFF_STEPS)
        self.length = 1
