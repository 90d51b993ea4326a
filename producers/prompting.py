"""Tokenize prompts at the producer, the way the edge does: the served model's tokenizer, with its
chat template for chat requests. CPU only; ``transformers`` is imported when a tokenizer loads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.messages import ChatMessage


class PromptTooLong(ValueError):
    pass


class Tokenizer:
    """Wraps an HF tokenizer plus the model's context length."""

    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len

    @classmethod
    def for_model(cls, model: str) -> "Tokenizer":
        """``model`` is anything ``--model`` accepts (default name, folder, hub id)."""
        from transformers import AutoTokenizer

        from engine_workers.model_store import resolve_model

        path = resolve_model(model)
        tok = AutoTokenizer.from_pretrained(str(path))
        ctx = 0
        cfg = Path(str(path)) / "config.json"
        if cfg.is_file():
            ctx = int(json.loads(cfg.read_text()).get("max_position_embeddings") or 0)
        return cls(tok, ctx or int(getattr(tok, "model_max_length", 2048) or 2048))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                                  tokenize=False, add_generation_prompt=True)
        return self._check(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))

    def text(self, prompt: str) -> list[int]:
        return self._check(list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]))

    def _check(self, ids: list[int]) -> list[int]:
        if not ids:
            raise PromptTooLong("prompt tokenizes to nothing")
        if len(ids) >= self.context_len:
            raise PromptTooLong(f"prompt is {len(ids)} tokens; the model's context is {self.context_len}")
        return ids

    def room(self, prompt_len: int, max_tokens: int) -> int:
        """``max_tokens`` clamped so prompt + output fit the context (as the edge does)."""
        return max(1, min(max_tokens, self.context_len - prompt_len))
