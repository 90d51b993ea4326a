"""Incremental detokenization with stop strings.

Text is produced token by token by decoding a small sliding window (the offsets technique vLLM and
TGI use): decoding ``ids[prefix:]`` and ``ids[prefix:read]`` and emitting the difference gives the
right spacing for SentencePiece and byte-level BPE alike. A window whose text ends in U+FFFD is an
incomplete UTF-8 sequence: nothing is emitted until the character completes, so a client never sees
half a multibyte character.

Stop strings: the text is searched as it grows; on a match the text is cut before the stop string.
Until a request finishes, the last ``len(longest stop) - 1`` characters are held back, so a stop
string never leaks into what was already released.
"""

from __future__ import annotations

from collections.abc import Sequence

_PROMPT_CONTEXT = 6  # prompt tokens decoded along with the first output tokens, for spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text decoded so far (cut at a stop string once matched)
        self.released = 0  # characters of ``text`` handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> bool:
        """Add one output token. Returns True when a stop string matched (text is cut before it)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # nothing printable yet (special token, or an incomplete character)
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            return self._find_stop(start)
        return False

    def _find_stop(self, new_from: int) -> bool:
        lo = max(0, new_from - self._hold)
        best = None
        for s in self._stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stopped_by = best[1]
        return True

    def release(self, final: bool) -> str:
        """Text that is now safe to send: everything when ``final``, else all but the hold-back."""
        end = len(self.text) if final or self.stopped_by else max(self.released, len(self.text) - self._hold)
        out = self.text[self.released : end]
        self.released = end
        return out
