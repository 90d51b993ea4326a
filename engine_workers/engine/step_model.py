"""How long a step takes, measured online: the step time as a line in the tokens it batches.

Pure (no clock: the engine passes each step's measured seconds). A step's time on a given
machine and model is close to ``a + b * tokens`` over the range a scheduler uses (a fixed cost per
step: weights read once, Python and kernel launches; plus a cost per batched token), so a least-
squares line over the last ``window`` steps predicts the next one. Two uses:

* the scheduler's TPOT-sized step (:meth:`StepModel.budget`): the most tokens a step may batch so
  that it lasts at most the strictest time-per-output-token target of the running decodes (each
  decode gets one token per step, so a step's time *is* their TPOT);
* the worker's TTFT prediction (``engine_workers/worker/intake/predict.py`` reads the same kind of
  line from the snapshot's step times).

Until ``min_samples`` steps spanning two different sizes were seen, there is no line (None): the
callers then keep their fixed budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepLine:
    """``seconds(tokens) = fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * max(0, tokens)

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a step of at most ``seconds`` batches (0 when even an empty one is longer)."""
        if seconds <= self.fixed_s:
            return 0
        if self.per_token_s <= 0:
            return 1 << 30
        return int((seconds - self.fixed_s) / self.per_token_s)


class StepModel:
    """Least-squares line over the last ``window`` (tokens, seconds) samples. Not thread-safe:
    the engine's step loop owns it."""

    def __init__(self, window: int = 128, min_samples: int = 8) -> None:
        if window < 2 or not 2 <= min_samples <= window:
            raise ValueError(f"need window >= 2 and 2 <= min_samples <= window, got {window}, {min_samples}")
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._line: StepLine | None = None
        self._dirty = False

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._samples.append((tokens, seconds))
            self._dirty = True

    def line(self) -> StepLine | None:
        if self._dirty:
            self._line = fit(list(self._samples), self.min_samples)
            self._dirty = False
        return self._line

    def budget(self, target_s: float) -> int | None:
        """Tokens one step may batch and last at most ``target_s`` (None: no line yet)."""
        line = self.line()
        return None if line is None else line.tokens_within(target_s)


def fit(samples: list[tuple[int, float]], min_samples: int = 2) -> StepLine | None:
    """The least-squares line through ``samples``; None with too few, or all of one size. A
    negative fixed cost or slope (noise on a shared machine) is clamped to 0 and the other term
    refitted, so the line never predicts a step faster than it measured on average."""
    if len(samples) < min_samples:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(s for _, s in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    if var <= 0:
        return None
    slope = sum((t - mx) * (s - my) for t, s in samples) / var
    fixed = my - slope * mx
    if slope < 0:
        return StepLine(my, 0.0)
    if fixed < 0:
        return StepLine(0.0, my / mx)
    return StepLine(fixed, slope)
