"""The MTP proposer: a checkpoint's own multi-token-prediction module (DeepSeek-V3-style,
:mod:`engine_workers.model.models.mtp`) guesses each speculating request's next tokens.

The module at position ``i`` reads the target's hidden state ``h_i`` and token ``t_{i+1}`` and
predicts ``t_{i+2}``. So the engine hands it, after every target forward, the hidden states of
the positions the target computed and kept (:meth:`MtpProposer.observe`: prefill rows, decode
rows, and the accepted rows of a verification chunk; rejected rows are dropped), and the proposer
keeps them per request until its module has consumed them. A proposal round for a request of
``N`` known tokens (target K/V up to ``N - 1``): one forward over the positions the module has not
computed yet, up to ``N - 2`` (``h_{N-2}`` with ``t_{N-1}``), gives ``d1``; then ``d_j`` is fed
at the next position with the module's own output state standing in for the target's, for
``d_{j+1}``. Those chained positions are never kept: after each round the module's K/V count
goes back to ``N - 2`` (the last real position is recomputed at the next round, with its stored
``h``), so nothing needs rolling back after verification. A request's positions served from the
prefix cache have no target state: the module starts after them (lower acceptance, never other
tokens: the target verifies every proposal).

Draws: as the draft model's (:mod:`engine_workers.engine.draft`), with the request's own
``(seed, position)`` uniforms on the module's logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from engine_workers.engine.draft import DraftItem
from engine_workers.engine.sampler import Row, Sampler
from engine_workers.engine.sequence import Sequence
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import ModelRunner, kv_budget_blocks
from engine_workers.model.loading.loader import LoadedModel
from engine_workers.model.models.mtp import MtpForPagedLM
from kv_store import KVCacheManager

log = logging.getLogger(__name__)


class MtpProposer:
    """Not thread-safe: the engine's step loop owns it (on the torch thread)."""

    def __init__(self, mtp: LoadedModel, vocab_size: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, kv_cache_bytes: int | None, memory_fraction: float,
                 sampler: Sampler) -> None:
        assert isinstance(mtp.model, MtpForPagedLM)
        self.model: MtpForPagedLM = mtp.model
        self.vocab_size = vocab_size
        num_blocks = kv_budget_blocks(mtp.spec, block_size, kv_dtype, device, kv_cache_bytes, memory_fraction)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(mtp, num_blocks, block_size, device, dtype, cpu_kernels=False, kv_dtype=kv_dtype)
        self.sampler = sampler
        self.max_len = mtp.spec.max_position_embeddings
        # per request: (first position, target states [n, hidden] of positions first..first+n-1):
        # the states the module has not consumed yet; its K/V are valid below ``first``
        self._states: dict[str, tuple[int, torch.Tensor]] = {}
        self.forwards = 0
        log.info("MTP module: KV %d blocks (%d tokens)", num_blocks, num_blocks * block_size)

    def observe(self, seq: Sequence, start: int, states: torch.Tensor) -> None:
        """The target computed positions ``start..start + len(states) - 1`` of ``seq`` (only
        positions below its computed count are kept: a verification chunk's rejected rows are not)."""
        keep = min(states.shape[0], seq.num_computed_tokens - start)
        if keep <= 0:
            return
        rows = states[:keep]
        held = self._states.get(seq.seq_id)
        if held is not None and held[0] + held[1].shape[0] == start:
            self._states[seq.seq_id] = (held[0], torch.cat([held[1], rows]))
        elif held is not None and held[0] <= start < held[0] + held[1].shape[0]:  # recomputed rows: the same states
            self._states[seq.seq_id] = (held[0], torch.cat([held[1][: start - held[0]], rows]))
        else:  # first rows, or after a gap (prefix-cache hit): the module starts here
            self._states[seq.seq_id] = (start, rows.clone())

    def propose(self, items: Seq[DraftItem]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in items]
        live: list[int] = []
        chunks: list[Chunk] = []
        prev: list[torch.Tensor] = []
        for i, it in enumerate(items):
            s = it.seq
            held = self._states.get(s.seq_id)
            n = s.num_tokens
            if held is None or held[0] + held[1].shape[0] != n - 1 or min(it.k, self.max_len - n + 1) < 1:
                continue
            first, states = held
            if not self.kv.allocate(s.seq_id, n - 2 + it.k):
                continue
            live.append(i)
            chunks.append(Chunk(s.all_token_ids[first + 1 : n], first, self.kv.block_ids(s.seq_id), True))
            prev.append(states)
        last: list[torch.Tensor] = []
        ran = list(live)
        while live:
            tokens, hidden = self._draw([items[i].seq for i in live], [out[i] for i in live], chunks, prev)
            for i, t in zip(live, tokens, strict=True):
                out[i].append(t)
            ends = [c.start + len(c.token_ids) for c in chunks]
            keep = [j for j, i in enumerate(live) if len(out[i]) < items[i].k]
            last = [hidden[j : j + 1] for j in keep]
            chunks = [Chunk([out[live[j]][-1]], ends[j], self.kv.block_ids(items[live[j]].seq.seq_id), True)
                      for j in keep]
            prev = last
            live = [live[j] for j in keep]
        for i in ran:  # K/V kept below N - 2 only; the state of N - 2 stays for the next round
            s = items[i].seq
            held = self._states[s.seq_id]
            self._states[s.seq_id] = (s.num_tokens - 2, held[1][-1:])
            self.kv.truncate(s.seq_id, s.num_tokens - 2)
        return out

    def _draw(self, seqs: list[Sequence], drafted: list[list[int]], chunks: list[Chunk],
              prev: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """One module forward: each chunk's last row drawn as the target would draw its position;
        also those rows' output states (the next round's stand-in for the target's)."""
        self.model.prev_hidden = torch.cat(prev)
        try:
            res = self.runner.execute(ModelInput(tuple(chunks), states=True))
        finally:
            self.model.prev_hidden = None
        self.forwards += 1
        assert res.states is not None
        ends = torch.tensor([0] + [len(c.token_ids) for c in chunks]).cumsum(0)[1:] - 1
        rows = [Row(s.params, s.seed, s.prompt_token_ids, s.output_token_ids + d) for s, d in zip(seqs, drafted)]
        tokens = self.sampler(res.logits[:, : self.vocab_size], rows).token_ids
        return tokens, res.states.index_select(0, ends.to(res.states.device))

    def forget(self, seq_id: str) -> None:
        self._states.pop(seq_id, None)
        self.kv.free(seq_id)

    def num_tracked(self) -> int:
        return len(self._states)
