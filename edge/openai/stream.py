"""One OpenAI-API request in flight: the :class:`~edge.admission.lifecycle.StreamSink` the stream
lifecycle feeds, and the JSON it becomes (SSE ``chat.completion.chunk`` / ``text_completion``
events, or one final object).

Concurrency: the lifecycle calls ``on_delta``/``on_end`` synchronously on the event loop; they only
append to ``pending`` (SSE bytes) or the collected text and wake the request's handler task, which
does all the writing (:mod:`edge.openai.routes`). Counting and releasing are the lifecycle's, not
this sink's. ``pending`` is bounded by ``send_queue_frames`` events: a client that reads slower than
tokens arrive overflows it; ``on_delta`` then aborts its connection and answers ``False``, and the
lifecycle fails the request (``overloaded``, Cancel reason ``slow_client``), as on the WebSocket path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson

from edge.admission.lifecycle import Done, End, Failed, Stream
from edge.chat.reasoning import REASONING, ReasoningStream
from edge.chat.tool_parsers import configured_parser
from edge.chat.tools import ToolStream, message_calls
from edge.config import EdgeConfig
from edge.openai.schema import ErrorReply, OpenAIRequest, error_reply
from edge.request import PromptEncoder

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class OpenAIStream:
    """The sink of one choice of a request. ``bind`` after admission; then the handler loops on
    the shared wake event + :meth:`take` (streaming) or waits on it until ``closed`` (not)."""

    def __init__(self, config: EdgeConfig, req: OpenAIRequest, encoder: PromptEncoder, max_pending: int,
                 on_overflow: Callable[[], None], wake: asyncio.Event, index: int = 0, echo: str = "") -> None:
        """``index``: the choice this sink answers (one sink per choice, ``n`` = 1 included, all
        sharing the handler's ``wake`` event; the handler writes the role events, the usage chunk
        and ``[DONE]`` for all of them, so a sink writes none).
        ``echo``: completions' ``echo``, the prompt's text, sent before the choice's own."""
        self.req = req
        self.encoder = encoder
        self.max_pending = max_pending
        self.on_overflow = on_overflow
        self.created = int(time.time())
        self.model = req.generate.model or config.model  # the name asked for: the base model or an adapter (as vLLM)
        self.id = ""
        self.seed: int | None = None
        self.stream: Stream | None = None
        self.pending: list[bytes] = []
        self.texts: list[str] = []
        self.lp_entries: list[Any] = []  # collected logprobs (non-streaming)
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: ErrorReply | None = None
        self.closed = False  # the stream ended: nothing more will be added
        self.started = False  # the first output (a token, the end or an error) has arrived
        self.index = index
        self.echo = echo
        self._wake = wake
        # a resumable chat stream (edge.openai.resume): every event carries ``id: <n>`` (0, 1, ...:
        # the role event, the choice's events, the usage chunk, ``[DONE]``), the position a client
        # resumes after; events at or below ``skip_through`` (the client has them) are dropped
        self.numbered = False
        self.skip_through = -1
        self._next_id = 0
        self.detached = False  # a resumable stream whose client went away: its events are dropped
        self._prefix = b""
        self._suffix = b""
        self._text_offset = 0
        # tools offered: the output is read for calls (streamed: incrementally, edge.chat.tools)
        self.tools = ToolStream(configured_parser(config.tool_call_parser, config.model, config.model_path)) if req.tools is not None and req.tools.active else None
        # --reasoning-parser (chat): <think>...</think> goes to reasoning_content, the rest is the answer
        parser = config.reasoning_parser
        self.reasoning = ReasoningStream(parser) if parser is not None and req.chat else None
        self.reasoning_texts: list[str] = []

    # --- set up -------------------------------------------------------------------------------
    def bind(self, s: Stream, seed: int | None) -> None:
        """Start the answer of admitted stream ``s``; ``seed`` is the sampling seed the request
        runs with (the client's, or the one the edge assigned), sent as the extension field
        ``seed`` on every object so a client can reproduce the answer."""
        self.stream = s
        self.seed = seed
        self.id = ("chatcmpl-" if self.req.chat else "cmpl-") + s.request_id
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "seed": seed}
        # Every token's event is prefix + JSON string + suffix: one orjson call per token.
        self._prefix = b"data: " + orjson.dumps(head)[:-1] + (
            b',"choices":[{"index":%d,"delta":{"content":' % self.index if self.req.chat
            else b',"choices":[{"index":%d,"text":' % self.index)
        tail = b',"logprobs":null,"finish_reason":null}]'
        self._suffix = (b"}" if self.req.chat else b"") + tail + (b',"usage":null' if self.req.include_usage else b"") \
            + b"}\n\n"
        if self.numbered:
            self._next_id = 1  # 0 is the role event's, written first by the handler
        if self.echo and self.req.stream:  # the prompt's text is the first event of the choice
            self.pending.append(self._prefix + orjson.dumps(self.echo) + self._suffix)

    def event(self, data: bytes, event_id: int | None = None) -> bytes:
        """``data`` (one SSE event) as sent: with its ``id:`` line when numbered (the next id, or
        ``event_id``); empty when the client already has it."""
        if not self.numbered:
            return data
        if event_id is None:
            event_id, self._next_id = self._next_id, self._next_id + 1
        return b"" if event_id <= self.skip_through else b"id: %d\n" % event_id + data

    def _emit(self, data: bytes) -> None:
        out = self.event(data)
        if out:
            self.pending.append(out)

    def head(self, **extra: Any) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.req.chat else "text_completion",
                               "created": self.created, "model": self.model, "seed": self.seed}
        obj.update(extra)
        return obj

    def role_event(self) -> bytes:
        """The first chat event: the assistant role, empty content (as OpenAI sends)."""
        return self.event(sse(self.head(choices=[{"index": self.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                              **({"usage": None} if self.req.include_usage else {}))), 0)

    # --- the sink: lifecycle events -> SSE bytes / the collected answer ----------------------------
    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...],  # noqa: ARG002 - the sink's signature
                 logprobs: tuple | None) -> bool:
        if self.detached:
            return True
        self.started = True
        lp = self._logprobs(logprobs) if self.req.logprobs is not None else None
        if self.reasoning is None:
            if not self.req.stream:
                self.texts.append(text)
                if lp is not None:
                    self.lp_entries.append(lp)
                return True
            self._content(text, lp)
        else:
            parts = self.reasoning.feed(text)
            if not self.req.stream:
                for kind, part in parts:
                    (self.reasoning_texts if kind == REASONING else self.texts).append(part)
                if lp is not None:
                    self.lp_entries.append(lp)
                return True
            self._parts(parts, lp)
        self._wake.set()
        if len(self.pending) > self.max_pending:
            self.on_overflow()
            if self.numbered:  # resumable: the client may resume it; the request runs on
                self.detached, self.pending = True, []
                return True
            return False  # the lifecycle fails the stream; on_end writes the error event
        return True

    def _parts(self, parts: list[tuple[str, str]], lp: dict[str, Any] | None) -> None:
        """Streamed reasoning-split parts; the chunk's logprobs ride on its first event."""
        if not parts and lp is not None:
            parts = [("content", "")]
        for kind, part in parts:
            if kind == REASONING:
                self._delta_event({"reasoning_content": part}, lp)
            else:
                self._content(part, lp)
            lp = None

    def _content(self, text: str, lp: dict[str, Any] | None) -> None:
        """Streamed answer text: read for tool calls when tools are offered."""
        if self.tools is not None:
            for i, delta in enumerate(self.tools.feed(text)):
                self._tool_delta(delta, lp if i == 0 else None)
        elif lp is None:
            self._emit(self._prefix + orjson.dumps(text) + self._suffix)
        else:
            choice: dict[str, Any] = {"index": self.index, "logprobs": lp, "finish_reason": None}
            if self.req.chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            self._emit(sse(self.head(choices=[choice], **({"usage": None} if self.req.include_usage else {}))))

    def _tool_delta(self, delta: dict[str, Any], lp: dict[str, Any] | None) -> None:
        """A tool stream's delta; with ``parallel_tool_calls`` false, calls after the first are dropped."""
        calls = delta.get("tool_calls")
        if calls is not None and not self.req.parallel_tool_calls:
            calls = [c for c in calls if c["index"] == 0]
            if not calls:
                return
            delta = {**delta, "tool_calls": calls}
        self._delta_event(delta, lp)

    def on_end(self, s: Stream, end: End) -> None:
        self.started = True
        if self.closed or self.detached:
            self.closed = True
            return
        if isinstance(end, Done):
            self._done(s, end)
        elif isinstance(end, Failed):
            self.error = error_reply(end.code, end.message, end.retry_after)
            if self.req.stream:  # after the 200 went out the error is an event (the handler then writes [DONE])
                self._emit(sse(self.error.body))
        # Cancelled: the handler is leaving; nothing more is written
        self.closed = True
        self._wake.set()

    def _done(self, s: Stream, end: Done) -> None:
        completion = end.completion_tokens
        self.usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": completion,
                      "total_tokens": s.prompt_tokens + completion,
                      "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}
        self.finish_reason = end.finish_reason
        if self.reasoning is not None:
            rest = self.reasoning.finish()
            if self.req.stream:
                self._parts(rest, None)
            else:
                for kind, part in rest:
                    (self.reasoning_texts if kind == REASONING else self.texts).append(part)
        if self.req.stream:
            if self.tools is not None:
                for delta in self.tools.finish():
                    self._tool_delta(delta, None)
                if self.tools.calls and end.finish_reason == "stop":
                    self.finish_reason = "tool_calls"
            choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": self.finish_reason}
            if self.req.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            self._emit(sse(self.head(choices=[choice], **({"usage": None} if self.req.include_usage else {}))))

    def _delta_event(self, delta: dict[str, Any], lp: dict[str, Any] | None) -> None:
        self._emit(sse(self.head(choices=[{"index": self.index, "delta": delta, "logprobs": lp,
                                           "finish_reason": None}],
                                 **({"usage": None} if self.req.include_usage else {}))))

    # --- the handler's side -------------------------------------------------------------------
    def take(self) -> bytes:
        out, self.pending = self.pending, []
        return b"".join(out)

    def response(self) -> dict[str, Any]:
        """The non-streaming answer (``chat.completion`` / ``text_completion``) once closed."""
        text = "".join(self.texts)
        lp: Any = None
        if self.req.logprobs is not None:
            lp = {"content": [e for c in self.lp_entries for e in c["content"]], "refusal": None} if self.req.chat \
                else _merge_completion_logprobs(self.lp_entries)
        if self.req.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if self.reasoning is not None:
                message["reasoning_content"] = "".join(self.reasoning_texts) or None
            finish_reason = self.finish_reason
            if self.tools is not None:
                content, calls = self.tools.parser.parse(text)
                if not self.req.parallel_tool_calls:
                    calls = calls[:1]
                if calls:
                    message.update(content=content, tool_calls=message_calls(calls))
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choice = {"index": self.index, "message": message, "logprobs": lp, "finish_reason": finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": self.index, "text": self.echo + text, "logprobs": lp,
                      "finish_reason": self.finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "seed": self.seed,
                "choices": [choice], "usage": self.usage}

    # --- logprobs -----------------------------------------------------------------------------
    def _piece(self, token_id: int) -> str:
        return str(self.encoder.tokenizer.decode([token_id]))

    def _logprobs(self, logprobs: tuple | None) -> dict[str, Any]:
        """OpenAI's logprobs object for one chunk. Each position's worker entry is the sampled
        token's (id, logprob) first, then the top alternatives."""
        positions = list(logprobs or ())
        if self.req.chat:
            content = []
            for pos in positions:
                if not pos:
                    continue
                tok, lp = pos[0]
                piece = self._piece(tok)
                content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                                "top_logprobs": [{"token": (p := self._piece(t)), "logprob": v, "bytes": list(p.encode())}
                                                 for t, v in pos[1:]]})
            return {"content": content, "refusal": None}
        tokens, token_lps, tops, offsets = [], [], [], []
        for pos in positions:
            if not pos:
                continue
            tok, lp = pos[0]
            piece = self._piece(tok)
            tokens.append(piece)
            token_lps.append(lp)
            tops.append({self._piece(t): v for t, v in pos[1:]})
            offsets.append(self._text_offset)
            self._text_offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merged_usage(sinks: list[OpenAIStream]) -> dict[str, Any] | None:
    """The usage of ``n`` choices of each prompt (one, or a completions batch): each prompt
    counted once (its first choice's count), the completions summed."""
    usages = [s.usage for s in sinks]
    if any(u is None for u in usages):
        return None
    firsts = [s.usage for s in sinks if s.index % s.req.n == 0 and s.usage is not None]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages if u is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merged_response(sinks: list[OpenAIStream]) -> dict[str, Any]:
    """One ``chat.completion`` / ``text_completion`` holding every choice, in index order (the
    sinks' order)."""
    out = sinks[0].response()
    out["choices"] = [s.response()["choices"][0] for s in sinks]
    out["usage"] = merged_usage(sinks)
    return out


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out
