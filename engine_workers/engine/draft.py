"""The draft-model proposer: a smaller checkpoint with the target's tokenizer guesses each
speculating request's next ``k`` tokens, one batched draft forward per guessed position.

The draft keeps a paged K/V cache of its own (its own :class:`~kv_store.KVCacheManager` and
:class:`~engine_workers.model.execution.runner.ModelRunner`, no prefix caching) and a count per
request of the tokens whose draft K/V are valid. A proposal round for requests of ``N`` known
tokens: one forward catches the draft up (every token from its count to ``N``: the whole prompt
the first time, the tokens accepted since the last round after) and gives ``d1``; then ``d_j`` is
fed at position ``N + j - 1`` for ``d_{j+1}``, up to ``k`` tokens. The draft's K/V past ``N``
are valid only as far as the fed proposals were accepted: at the request's next round the draft
compares them with the tokens the request has by then and cuts its count and blocks at the first
difference (the rollback; it needs nothing from the verification, so a proposal the scheduler
dropped or a step the request sat out cannot leave stale K/V behind). What the draft proposes never changes the tokens a request produces (the target verifies
every one: engine.core), only how many are accepted per step.

The draft draws with the target's sampler and the request's own ``(seed, position)`` draws
(:mod:`engine_workers.engine.sampler`), on its own logits: greedy requests get the draft's argmax,
sampled ones the draft's token for the same uniform the target will use at that position, so a
draft whose distribution is close to the target's proposes exactly the target's token most of
the time, at any temperature (the coupling is free: the draws are counter-based).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine_workers.engine.sampler import Row, Sampler
from engine_workers.engine.sequence import Sequence
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import ModelRunner, kv_budget_blocks
from engine_workers.model.loading.loader import LoadedModel
from kv_store import KVCacheManager
from tokenization.model_store import ModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftItem:
    """One request to propose for this step: ``k`` tokens at most (``k >= 1``)."""

    seq: Sequence
    k: int


def check_tokenizers(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer maps any token differently from the target's (its
    proposals would be other tokens' ids). A larger embedding (padded vocabulary) is fine: the
    draft's rows past the target's vocabulary are never proposed."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()  # type: ignore[attr-defined]
    if tv != dv:
        only_t = sorted(set(tv.items()) - set(dv.items()))[:3]
        only_d = sorted(set(dv.items()) - set(tv.items()))[:3]
        raise ModelError(f"draft model {draft.path} has a different tokenizer from the target {target.path} "
                         f"({len(tv)} vs {len(dv)} tokens; e.g. target-only {only_t}, draft-only {only_d}): "
                         "a draft model must share the target's tokenizer")
    if draft.spec.vocab_size < target.spec.vocab_size:
        raise ModelError(f"draft model {draft.path} has {draft.spec.vocab_size} vocabulary rows, fewer than the "
                         f"target's {target.spec.vocab_size}")


class DraftProposer:
    """Not thread-safe: the engine's step loop owns it (on the torch thread)."""

    def __init__(self, draft: LoadedModel, vocab_size: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, cpu_kernels: bool, kv_cache_bytes: int | None,
                 memory_fraction: float, sampler: Sampler) -> None:
        """``vocab_size``: the target's (proposals are drawn among its tokens only)."""
        self.loaded = draft
        self.vocab_size = vocab_size
        self.max_len = draft.spec.max_position_embeddings
        num_blocks = kv_budget_blocks(draft.model.spec, block_size, kv_dtype, device, kv_cache_bytes, memory_fraction)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(draft, num_blocks, block_size, device, dtype, cpu_kernels, kv_dtype)
        self.sampler = sampler
        self._computed: dict[str, int] = {}  # per request: tokens whose draft K/V are valid
        # per request: (N, the proposals fed at positions N, N+1, ...) of its last round, not yet
        # checked against the tokens the verification accepted
        self._fed: dict[str, tuple[int, list[int]]] = {}
        self.forwards = 0  # draft forwards run (tests, the benchmark)
        log.info("draft model %s: KV %d blocks (%d tokens)", draft.path, num_blocks, num_blocks * block_size)

    def propose(self, items: Seq[DraftItem]) -> list[list[int]]:
        """Up to ``item.k`` tokens for each item, in order (empty where the draft's context or
        K/V cache has no room: that request does not speculate this step)."""
        out: list[list[int]] = [[] for _ in items]
        live: list[int] = []
        for i, it in enumerate(items):
            self._reconcile(it.seq)
            n = it.seq.num_tokens
            k = min(it.k, self.max_len - n)
            if k < 1 or not self._reserve(it.seq.seq_id, n + k - 1):
                continue
            live.append(i)
        # round 0 catches each request up and drafts d1; round j feeds d_j for d_{j+1}
        chunks: list[Chunk] = []
        for i in live:
            s = items[i].seq
            # at least the last token: a request whose proposals all went unverified (not
            # scheduled, preempted) has its K/V up to N already and needs that row's logits again
            start = min(self._computed.get(s.seq_id, 0), s.num_tokens - 1)
            chunks.append(Chunk(s.all_token_ids[start:], start, self.kv.block_ids(s.seq_id), True))
        while live:
            tokens = self._draw([items[i].seq for i in live], [out[i] for i in live], chunks)
            for i, t, c in zip(live, tokens, chunks, strict=True):
                out[i].append(t)
                self._computed[items[i].seq.seq_id] = c.start + len(c.token_ids)
            live = [i for i in live if len(out[i]) < min(items[i].k, self.max_len - items[i].seq.num_tokens)]
            for i in live:  # about to feed its last proposal
                s = items[i].seq
                self._fed.setdefault(s.seq_id, (s.num_tokens, []))[1].append(out[i][-1])
            chunks = [Chunk([out[i][-1]], items[i].seq.num_tokens + len(out[i]) - 1,
                            self.kv.block_ids(items[i].seq.seq_id), True) for i in live]
        return out

    def _reserve(self, seq_id: str, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` draft positions; on a full cache the request's draft state is
        dropped (it is recomputed from the start when it next speculates)."""
        if self.kv.allocate(seq_id, num_tokens):
            return True
        self.forget(seq_id)
        return False

    def _draw(self, seqs: list[Sequence], drafted: list[list[int]], chunks: list[Chunk]) -> list[int]:
        """One draft forward; each row drawn as the target would draw its position (see the module doc)."""
        logits = self.runner.execute(ModelInput(tuple(chunks))).logits[:, : self.vocab_size]
        self.forwards += 1
        rows = [Row(s.params, s.seed, s.prompt_token_ids, s.output_token_ids + d) for s, d in zip(seqs, drafted)]
        return self.sampler(logits, rows).token_ids

    def _reconcile(self, seq: Sequence) -> None:
        """The rollback: keep the draft K/V of the fed proposals the request's tokens now agree
        with, drop the rest (count and blocks)."""
        fed = self._fed.pop(seq.seq_id, None)
        if fed is None:
            return
        n, drafts = fed
        tokens = seq.all_token_ids
        ok = 0
        while ok < len(drafts) and n + ok < len(tokens) and tokens[n + ok] == drafts[ok]:
            ok += 1
        self._computed[seq.seq_id] = min(self._computed[seq.seq_id], n + ok)
        self.kv.truncate(seq.seq_id, self._computed[seq.seq_id])

    def num_valid(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose draft K/V are valid now (tests)."""
        self._reconcile(seq)
        return self._computed.get(seq.seq_id, 0)

    def forget(self, seq_id: str) -> None:
        """The request ended (or lost its draft blocks): free its draft state."""
        self._computed.pop(seq_id, None)
        self._fed.pop(seq_id, None)
        self.kv.free(seq_id)

    def num_tracked(self) -> int:
        return len(self._computed)
