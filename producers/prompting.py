"""Tokenize prompts at the producer, the way the edge does: the served model's tokenizer, with its
chat template for chat requests. CPU only; ``transformers`` is imported when a tokenizer loads."""

from __future__ import annotations

from collections.abc import Sequence

from bus import ChatMessage
from tokenization.prompts import PromptTokenizer


class PromptTooLong(ValueError):
    pass


class Tokenizer(PromptTokenizer):
    """The served model's :class:`~tokenization.prompts.PromptTokenizer` (the edge tokenizes with
    the same class), with the producers' checks."""

    @classmethod
    def for_model(cls, model: str) -> Tokenizer:
        """``model`` is anything ``--model`` accepts (default name, folder, hub id)."""
        from tokenization.model_store import resolve_model

        return cls.from_path(resolve_model(model))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self._check(self.chat_ids(messages))

    def text(self, prompt: str) -> list[int]:
        return self._check(self.text_ids(prompt))

    def _check(self, ids: list[int]) -> list[int]:
        if not ids:
            raise PromptTooLong("prompt tokenizes to nothing")
        if len(ids) >= self.context_len:
            raise PromptTooLong(f"prompt is {len(ids)} tokens; the model's context is {self.context_len}")
        return ids

    def room(self, prompt_len: int, max_tokens: int) -> int:
        """``max_tokens`` clamped so prompt + output fit the context (as the edge does)."""
        return max(1, min(max_tokens, self.context_len - prompt_len))
