"""Prompt -> token ids, one way for the whole platform: the served model's tokenizer, its chat
template for chat messages, and its context length.

The edge, the producers (batch, replay) and the offline engine all tokenize through this class, so
the same request tokenizes to the same ids wherever it enters — which is what makes greedy replays
and the edge-vs-engine comparisons exact. Callers add their own error types and limits.
Encoding is CPU-bound but thread-safe (HF fast tokenizers), so callers may run it in a thread.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

DEFAULT_CONTEXT_LEN = 2048  # when neither config.json nor the tokenizer states one


class PromptTokenizer:
    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len

    @classmethod
    def from_path(cls, path: str | Path) -> Self:
        """Tokenizer of a local HF folder; context length = config.json ``max_position_embeddings``."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        cfg = Path(str(path)) / "config.json"
        ctx = int(json.loads(cfg.read_text()).get("max_position_embeddings") or 0) if cfg.is_file() else 0
        return cls(tok, ctx or int(getattr(tok, "model_max_length", 0) or DEFAULT_CONTEXT_LEN))

    def chat_ids(self, messages: Iterable[Any]) -> list[int]:
        """Messages (``ChatMessage``-like objects or ``{"role", "content"}`` dicts) through the chat
        template with the generation prompt appended; the template supplies any special tokens."""
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text_ids(self, prompt: str) -> list[int]:
        """A raw prompt, with the tokenizer's own special tokens (BOS where the model uses one)."""
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
