"""Reasoning parsers: a reasoning model's ``<think>…</think>`` split from its answer, incrementally
(sans-I/O: text in, ``(kind, text)`` parts out), as vLLM's ``--reasoning-parser`` does.

* ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts inside
  the reasoning (a ``<think>`` the model writes anyway is dropped); everything up to ``</think>``
  is reasoning, the rest the answer. No ``</think>`` at all: all of it was reasoning (cut short).
* ``qwen3``: reasoning only when the output starts with ``<think>`` (Qwen3 with thinking off writes
  none); then up to ``</think>``.

A tag split across chunks is held back until it can be told apart from text; nothing else is
delayed. The tool-call parser and the grammar see only the answer part.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
REASONING, CONTENT = "reasoning", "content"


def _held(buf: str, tag: str) -> int:
    """How many trailing characters of ``buf`` may be the start of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(buf)), 0, -1) if tag.startswith(buf[-n:])), 0)


class ReasoningStream:
    """One output's split. ``feed`` each chunk's text, ``finish`` at the end; both return the
    parts to send now, in order, with no empty text."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
        self.parser = parser
        # deepseek_r1 starts in reasoning; qwen3 decides on the output's first characters
        self.state = REASONING if parser == "deepseek_r1" else "start"
        self.buf = ""
        self._lead = True  # no text sent yet in this state: a leading <think> is still droppable
        self._gap = False  # just after </think>: newlines are dropped until the answer starts

    @property
    def in_reasoning(self) -> bool:
        return self.state == REASONING

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(START):
                self.state, self.buf = REASONING, stripped[len(START):]
                self._lead = False
            elif START.startswith(stripped):
                return out  # may still become "<think>"
            else:
                self.state = CONTENT
        if self.state == REASONING:
            if self._lead:  # deepseek_r1: a <think> the model wrote although the template opened it
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self._lead = stripped[len(START):], False
                elif START.startswith(stripped) and stripped:
                    return out
                elif stripped:
                    self._lead = False
            end = self.buf.find(END)
            if end < 0:
                keep = _held(self.buf, END)
                emit, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if emit:
                    out.append((REASONING, emit))
                return out
            if end:
                out.append((REASONING, self.buf[:end]))
            self.state, self.buf, self._gap = CONTENT, self.buf[end + len(END):], True
        if self.state == CONTENT and self._gap:  # the blank lines after </think> belong to neither part
            self.buf = self.buf.lstrip("\n")
            self._gap = not self.buf
        if self.state == CONTENT and self.buf:
            out.append((CONTENT, self.buf))
            self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back: a partial tag that never completed is text of the state it is in."""
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        return [(REASONING if self.state == REASONING else CONTENT, rest)]


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a complete output; reasoning ``None`` when there was none."""
    rs = ReasoningStream(parser)
    parts = rs.feed(text) + rs.finish()
    reasoning = "".join(t for k, t in parts if k == REASONING)
    content = "".join(t for k, t in parts if k == CONTENT)
    return (reasoning or None), content
