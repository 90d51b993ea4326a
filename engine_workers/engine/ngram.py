"""The n-gram (prompt lookup) proposer: guesses a request's next tokens by finding where the end
of its text already occurred and copying what followed. Pure (no torch, no I/O).

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the last ``n`` tokens of
prompt + output are looked for earlier in the same tokens; the first length that matches wins
(longer matches predict better). Among that length's matches the most recent one that is followed
by ``k`` tokens is taken (recent text predicts the continuation best); when none is, the earliest
match, which is followed by the most. The proposal is up to ``k`` tokens that followed it. It
costs nothing when it is wrong beyond the verification rows: the target model checks every token
(engine.core, "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lookup_min}, {lookup_max}")
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``tokens`` (empty when nothing matches or ``k < 1``)."""
        size = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.lookup_max, size - 1), self.lookup_min - 1, -1):
            start = self._match(tokens, n, k)
            if start is not None:
                return list(tokens[start + n : start + n + k])
        return []

    @staticmethod
    def _match(tokens: Sequence[int], n: int, k: int) -> int | None:
        """Start of the chosen earlier occurrence of the last ``n`` tokens (see the module doc)."""
        size = len(tokens)
        suffix = list(tokens[size - n :])
        last = suffix[-1]
        earliest = None
        # i: start of a candidate; it must end before the suffix itself starts to be followed by a token
        for i in range(size - n - 1, -1, -1):
            if tokens[i + n - 1] != last or list(tokens[i : i + n]) != suffix:
                continue
            if size - n - i >= k:
                return i  # the most recent match followed by k tokens
            earliest = i
        return earliest
