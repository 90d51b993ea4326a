"""Synthetic serving workloads: a seeded length mix shaped like chat traffic and arrival processes.
Pure: standard library only (``random``), so the same seed gives the same workload everywhere.

* Lengths: prompt and output lengths are lognormal (chat traffic is right-skewed: many short
  turns, a long tail of pasted documents and long answers), clipped to ``[min, max]``. Defaults:
  median prompt ~ 120 tokens, median output ~ 60 tokens.
* Tiers: each request picks a tier from ``tier_weights`` (p0, p1, p2).
* Arrivals: ``poisson`` = exponential gaps with mean 1/rate; ``bursty`` = gamma gaps with shape
  ``burstiness`` < 1 and the same mean (vLLM's ``--burstiness``: 1.0 is Poisson, smaller is burstier).
  ``rate = inf`` sends everything at t = 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

ARRIVALS = ("poisson", "bursty")

# Common English words; each is usually one token for BPE vocabularies such as SmolLM2's.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their been has when who will more no if out so said what up its "
    "about into than them can only other new some time could these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three"
).split()


@dataclass(frozen=True, slots=True)
class LengthMix:
    """Lognormal lengths: ``median`` and ``sigma`` (of the underlying normal), clipped."""

    prompt_median: float = 120.0
    prompt_sigma: float = 0.9
    prompt_min: int = 4
    prompt_max: int = 1024
    output_median: float = 60.0
    output_sigma: float = 0.8
    output_min: int = 2
    output_max: int = 512
    tier_weights: tuple[float, ...] = (0.2, 0.6, 0.2)  # p0, p1, p2: three, checked below

    def __post_init__(self) -> None:
        for name in ("prompt_median", "output_median"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError("need 1 <= prompt_min <= prompt_max")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError("need 1 <= output_min <= output_max")
        if len(self.tier_weights) != 3 or min(self.tier_weights) < 0 or sum(self.tier_weights) <= 0:
            raise ValueError("tier_weights must be three non-negative weights (p0,p1,p2) with a positive sum")

    def scaled(self, prompt_max: int | None = None, output_max: int | None = None) -> LengthMix:
        """The same shape with smaller caps (medians shrink to stay within them)."""
        from dataclasses import replace

        pm = prompt_max or self.prompt_max
        om = output_max or self.output_max
        return replace(self, prompt_max=pm, output_max=om, prompt_min=min(self.prompt_min, pm),
                       output_min=min(self.output_min, om), prompt_median=min(self.prompt_median, pm / 4),
                       output_median=min(self.output_median, om / 3))


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    index: int
    prompt_len: int
    output_len: int
    tier: int
    at: float  # seconds after the start of the run


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def sample_lengths(n: int, mix: LengthMix, seed: int) -> list[tuple[int, int, int]]:
    """``n`` (prompt_len, output_len, tier) triples, deterministic for ``seed``."""
    rng = random.Random(f"lengths:{seed}")
    out = []
    for _ in range(n):
        p = _lognormal(rng, mix.prompt_median, mix.prompt_sigma, mix.prompt_min, mix.prompt_max)
        o = _lognormal(rng, mix.output_median, mix.output_sigma, mix.output_min, mix.output_max)
        tier = rng.choices((0, 1, 2), weights=mix.tier_weights)[0]
        out.append((p, o, tier))
    return out


def arrival_times(n: int, rate: float, kind: str = "poisson", seed: int = 0, burstiness: float = 0.25) -> list[float]:
    """Send times (seconds from start, non-decreasing, first one at 0) of ``n`` requests at ``rate``/s."""
    if kind not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {kind!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{kind}:{rate}:{seed}")
    shape = 1.0 if kind == "poisson" else burstiness
    if not shape > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))  # mean gap 1/rate for every shape
        out.append(t)
    return out


def workload(n: int, rate: float, mix: LengthMix, seed: int, kind: str = "poisson",
             burstiness: float = 0.25) -> list[SyntheticRequest]:
    """The full schedule of one run. Lengths depend on ``seed`` only (same mix at every rate)."""
    lengths = sample_lengths(n, mix, seed)
    times = arrival_times(n, rate, kind, seed, burstiness)
    return [SyntheticRequest(i, p, o, tier, at) for i, ((p, o, tier), at) in enumerate(zip(lengths, times))]


def synthetic_text(n_words: int, seed: int) -> str:
    """Deterministic filler prompt of ``n_words`` common words (about as many tokens for BPE
    vocabularies of real models; more for tiny test vocabularies). A seeded prefix keeps prompts
    distinct so the prefix cache does not make the benchmark meaningless."""
    rng = random.Random(f"text:{seed}")
    words = [f"#{seed}"] + [rng.choice(_WORDS) for _ in range(max(0, n_words - 1))]
    return " ".join(words)


def parse_rates(text: str) -> list[float]:
    """``1,2,4`` -> [1.0, 2.0, 4.0]; ``inf`` allowed."""
    rates = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"not a rate: {part!r} (use e.g. --rate 1,2,4)") from None
        if not r > 0:
            raise ValueError(f"rates must be > 0, got {part!r}")
        rates.append(r)
    if not rates:
        raise ValueError("give at least one rate")
    return rates
