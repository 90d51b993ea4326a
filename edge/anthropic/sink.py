"""One Messages request in flight: the :class:`~edge.admission.lifecycle.StreamSink` the stream
lifecycle feeds, and what it becomes: Anthropic's SSE events, or one ``message`` object.

The output is cut into content blocks as it arrives, in both modes (one code path): the
configured reasoning parser (:mod:`edge.chat.reasoning`) splits ``thinking`` from the answer, the
chat path's :class:`~edge.chat.tools.ToolStream` reads the answer for tool calls (``tool_use``
blocks whose input streams as ``input_json_delta`` fragments), the rest is ``text``. A block is
closed when the next kind starts. Streamed, each block is ``content_block_start``, its deltas,
``content_block_stop``; the message ends with ``message_delta`` (``stop_reason``, usage) and
``message_stop``. ``message_start`` and a ``ping`` are written by the handler in the same write
as the first output (:mod:`edge.anthropic.routes`), never before it.

Concurrency: the lifecycle calls ``on_delta``/``on_end`` synchronously on the event loop; they
append to ``pending`` and wake the handler, which does all the writing. ``pending`` is bounded by
``send_queue_frames`` events: a client that reads slower than tokens arrive overflows it,
``on_delta`` aborts its connection and answers ``False``, and the lifecycle fails the stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from edge.admission.lifecycle import Done, End, Failed, Stream
from edge.anthropic.errors import ErrorReply, error_reply, event
from edge.anthropic.schema import MessagesRequest
from edge.chat.reasoning import REASONING, ReasoningStream
from edge.chat.tool_parsers import ToolParser
from edge.chat.tools import ToolStream


class MessagesSink:
    """The sink of one Messages request. ``bind`` after admission; the handler then loops on
    ``wake`` + :meth:`take` (streaming) or waits on it until ``closed``."""

    def __init__(self, model: str, req: MessagesRequest, parser: ToolParser, reasoning_parser: str | None,
                 end_ids: frozenset[int], max_pending: int, on_overflow: Callable[[], None],
                 wake: asyncio.Event) -> None:
        """``end_ids``: the tokenizer's special ids. A ``stop`` finish whose last token is none of
        them was a stop sequence (the worker cuts the matched text, not the token that ended it)."""
        self.req = req
        self.model = model
        self.end_ids = end_ids
        self.max_pending = max_pending
        self.on_overflow = on_overflow
        self._wake = wake
        self.id = ""
        self.stream: Stream | None = None
        self.pending: list[bytes] = []
        self.blocks: list[dict[str, Any]] = []
        self._args: dict[int, str] = {}  # block index -> a tool_use block's input JSON text so far
        self._calls: dict[int, int] = {}  # ToolStream's call index -> its block index
        self._open: str | None = None  # the kind of the block being written
        self._last_token: int | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: ErrorReply | None = None
        self.started = False  # the first output (a token, the end or an error) has arrived
        self.closed = False
        tools = req.tools
        self.tools = ToolStream(parser) if tools is not None and tools.active else None
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser is not None else None

    def bind(self, s: Stream) -> None:
        self.stream = s
        self.id = "msg_" + s.request_id

    def head(self) -> bytes:
        """``message_start`` and a ``ping``: the stream's first write, together with the first output."""
        s = self.stream
        assert s is not None
        msg: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": s.prompt_tokens, "output_tokens": 0,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": msg}) + event("ping", {"type": "ping"})

    # --- the sink: lifecycle events -> blocks (and SSE bytes when streaming) -----------------------
    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...],  # noqa: ARG002 - the sink's signature
                 logprobs: tuple | None) -> bool:  # noqa: ARG002
        self.started = True
        if token_ids:
            self._last_token = token_ids[-1]
        self._feed(self.reasoning.feed(text) if self.reasoning is not None else [("content", text)])
        if not self.req.stream:
            return True
        self._wake.set()
        if len(self.pending) > self.max_pending:
            self.on_overflow()
            return False  # the lifecycle fails the stream; on_end writes the error event
        return True

    def on_end(self, s: Stream, end: End) -> None:
        self.started = True
        if self.closed:
            return
        if isinstance(end, Done):
            self._done(s, end)
        elif isinstance(end, Failed):
            self.error = error_reply(end.code, end.message, end.retry_after)
            self._emit("error", self.error.body)  # after the 200 went out, the error is an event
        # Cancelled: the handler is leaving; nothing more is written
        self.closed = True
        self._wake.set()

    def _feed(self, parts: list[tuple[str, str]]) -> None:
        for kind, part in parts:
            if kind == REASONING:
                if self.req.thinking_shown:
                    self._delta("thinking", "thinking_delta", part)
                elif self._open != "thinking" and part:  # display "omitted": the block, not its text
                    self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            elif self.tools is None:
                self._delta("text", "text_delta", part)
            else:
                for d in self.tools.feed(part):
                    self._tool(d)

    def _tool(self, d: dict[str, Any]) -> None:
        """A :class:`ToolStream` delta: content, a call's head, or a fragment of its arguments."""
        if "content" in d:
            self._delta("text", "text_delta", d["content"])
            return
        for c in d["tool_calls"]:
            if c["index"] > 0 and not self.req.parallel_tool_calls:
                continue  # disable_parallel_tool_use: the first call only
            if "id" in c:
                self._start("tool_use", {"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                                         "name": c["function"]["name"], "input": {}})
                self._args[len(self.blocks) - 1] = ""
                self._calls[c["index"]] = len(self.blocks) - 1
                continue
            block, frag = self._calls.get(c["index"]), c["function"].get("arguments")
            # a call's fragments follow its head, before the next block opens (ToolStream's order)
            if block is not None and block == len(self.blocks) - 1 and self._open == "tool_use" and frag:
                self._args[block] += frag
                self._emit("content_block_delta", {"type": "content_block_delta", "index": block,
                                                   "delta": {"type": "input_json_delta", "partial_json": frag}})

    def _start(self, kind: str, block: dict[str, Any]) -> None:
        self._stop()
        self.blocks.append(block)
        self._open = kind
        self._emit("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                           "content_block": block})

    def _stop(self) -> None:
        if self._open is not None:
            self._open = None
            self._emit("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})

    def _delta(self, kind: str, delta: str, text: str) -> None:
        """Text of a ``text`` or ``thinking`` block (opened when another kind was open)."""
        if not text:
            return
        if self._open != kind:
            self._start(kind, {"type": "text", "text": ""} if kind == "text"
                        else {"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1][kind] += text
        self._emit("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                           "delta": {"type": delta, kind: text}})

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        if self.req.stream:
            self.pending.append(event(kind, obj))

    def _done(self, s: Stream, end: Done) -> None:
        if self.reasoning is not None:
            self._feed(self.reasoning.finish())
        if self.tools is not None:
            for d in self.tools.finish():
                self._tool(d)
        self._stop()
        for i, text in self._args.items():
            try:
                args = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError:  # cut short (max_tokens): the input is what parses, nothing
                args = {}
            self.blocks[i] = {**self.blocks[i], "input": args if isinstance(args, dict) else {}}
        self.stop_reason = self._stop_reason(end.finish_reason)
        cached = end.cached_tokens
        self.usage = {"input_tokens": s.prompt_tokens - cached, "output_tokens": end.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
        self._emit("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                                     "usage": self.usage})
        self._emit("message_stop", {"type": "message_stop"})

    def _stop_reason(self, finish: str) -> str:
        if finish == "length":
            return "max_tokens"
        if self._args:
            return "tool_use"
        stops = self.req.generate.sampling.stop
        if finish == "stop" and stops and self._last_token is not None and self._last_token not in self.end_ids:
            # a stop sequence ended it; which one is known only when there is one
            self.stop_sequence = stops[0] if len(stops) == 1 else None
            return "stop_sequence"
        return "end_turn"

    # --- the handler's side -------------------------------------------------------------------------
    def take(self) -> bytes:
        out, self.pending = self.pending, []
        return b"".join(out)

    def response(self) -> dict[str, Any]:
        """The non-streamed ``message`` once closed."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}
