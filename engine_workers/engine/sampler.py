"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-n logprobs.

Greedy rows take the argmax of the raw logits. Other rows are scaled by temperature, filtered by
top-k then top-p (vectorised over the batch), and drawn with the request's own ``torch.Generator``
when it has a seed (same seed, same tokens, whatever else is in the batch) or the engine's
generator otherwise. Logprobs are those of the model's raw distribution (before temperature and
filtering), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_workers.engine.params import SamplingParams

TokenLogprobs = tuple[tuple[int, float], ...]  # (sampled id, logprob) first, then the top-n


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> SampleResult:
        """``logits`` ``[B, V]`` float32; ``params``/``generators`` per row."""
        b = logits.shape[0]
        greedy = [p.greedy for p in params]
        tokens = torch.empty(b, dtype=torch.long, device=logits.device)
        if any(greedy):
            rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=logits.device)
            tokens[rows] = logits.index_select(0, rows).argmax(dim=-1)
        if not all(greedy):
            rows_l = [i for i, g in enumerate(greedy) if not g]
            rows = torch.tensor(rows_l, device=logits.device)
            probs = self._filtered_probs(logits.index_select(0, rows), [params[i] for i in rows_l])
            for j, i in enumerate(rows_l):
                gen = generators[i] or self.generator
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * b
        want = {i: p.logprobs for i, p in enumerate(params) if p.logprobs is not None}  # row -> top-k
        if want:
            lp = torch.log_softmax(logits.index_select(0, torch.tensor(list(want), device=logits.device)), dim=-1)
            n = max(want.values())
            top_v, top_i = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], lp[:, :0].long())
            for j, (i, k) in enumerate(want.items()):
                tok = token_list[i]
                entries = [(tok, float(lp[j, tok]))]
                entries += list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
                logprobs[i] = tuple(entries)
        return SampleResult(token_list, logprobs)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[-1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            ps = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = before >= ps[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)
