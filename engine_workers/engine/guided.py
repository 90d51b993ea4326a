"""Constrained decoding (structured output) in the engine: per-request matchers and the batched
token mask. The grammars and their compile cache are shared with the edge (tokenization.grammars).

A request asks for at most one constraint (``SamplingParams.guided``): a JSON schema, any JSON
object, a regular expression, a choice among strings, or an EBNF grammar (the edge builds those for
tool calls). :class:`GrammarCache` compiles it against the served tokenizer on a small thread pool
(never on the engine's step thread when the request comes through :class:`AsyncEngine`) and keeps
the result per ``(kind, text)``; a :class:`Guide` is one request's matcher, advanced with every
token the request produces (resumed tokens first); :class:`MaskBuffer` fills one bitmask per step
for the constrained rows and applies it to their logits in place (xgrammar's kernel, no Python
loop over the vocabulary). See docs/design.md, "Structured output".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr

from tokenization.grammars import GrammarCache, GuidedSpec

__all__ = ["GrammarCache", "Guide", "GuidedSpec", "LazyGrammars", "MaskBuffer"]


class LazyGrammars:
    """An engine's :class:`GrammarCache`, built on first use (the tokenizer's grammar info takes
    ~0.5 s for a 49k vocabulary): engines that never see a guided request never pay for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                self._cache = GrammarCache(*self._args)
            return self._cache

    def compile_async(self, spec: GuidedSpec) -> Future:
        """The compiled grammar as a future; nothing is built or compiled on the calling thread."""
        if self._cache is not None:
            return self._cache.compile_async(spec)
        fut: Future = Future()

        def build() -> None:
            try:
                fut.set_result(self.get().compile(spec))
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)

        threading.Thread(target=build, name="lockgate-grammar-init", daemon=True).start()
        return fut


class Guide:
    """One request's matcher. ``accept`` advances it by a token (False: the grammar does not
    allow it); ``terminated`` once the grammar has ended (its stop token accepted)."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts one after another (up to the first it refuses,
        or through the one that ends it); the matcher is left as it was (rolled back)."""
        n = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            self.matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class MaskBuffer:
    """The per-step bitmask, reused while the batch fits (one ``[B, ceil(V/32)]`` int32 tensor)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buf: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, guided: Sequence[tuple[int, Guide]],
              ahead: Mapping[int, Sequence[int]] | None = None) -> None:
        """Mask in place the rows ``i`` of ``logits`` for each ``(i, guide)``: tokens the guide's
        grammar does not allow next become ``-inf``. Other rows are untouched.

        ``ahead`` (speculative verification): for a row ``i``, the proposed tokens that follow it;
        row ``i + j`` is masked with the grammar's state after the first ``j`` of them (walked and
        rolled back: the matcher ends as it was). They must be tokens the grammar accepts in turn
        (:meth:`Guide.allowed_prefix`)."""
        rows = logits.shape[0]
        if self._buf is None or self._buf.shape[0] < rows:
            self._buf = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        buf = self._buf
        indices = []
        for i, g in guided:
            g.matcher.fill_next_token_bitmask(buf, i)
            indices.append(i)
            walk = ahead.get(i, ()) if ahead else ()
            for j, t in enumerate(walk, 1):
                if not g.matcher.accept_token(t):
                    raise ValueError(f"proposed token {t} is not allowed by the grammar")
                g.matcher.fill_next_token_bitmask(buf, i + j)
                indices.append(i + j)
            if walk:
                g.matcher.rollback(len(walk))
        mask = buf if logits.device.type == "cpu" else buf.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]),
                                        indices=indices)
