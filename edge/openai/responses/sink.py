"""One ``/v1/responses`` request in flight: the :class:`~edge.admission.lifecycle.StreamSink` the
stream lifecycle feeds, and what it becomes: output items (an assistant ``message`` with ``output_text``, ``function_call``
items) in one ``response`` object, or, streamed, OpenAI's event sequence:
``response.created``, ``response.in_progress``, per item ``response.output_item.added``, (message)
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, (call) ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, (reasoning, with ``--reasoning-parser``)
``response.reasoning_text.delta`` ..., ``response.reasoning_text.done``, then
``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it,
``response.failed`` on an error). Every event carries ``sequence_number``.

The output is read through the chat path's :class:`~edge.chat.tools.ToolStream` in both modes,
so the non-streamed response is exactly what the streamed events add up to. Concurrency and
bounds as :mod:`edge.openai.stream`: ``on_delta``/``on_end`` only append and wake the handler, and
never call back into admission; ``pending`` over ``max_pending`` events has ``on_delta`` answer
``False``, and the lifecycle fails the request as a slow client.
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
from edge.chat.tools import ToolStream
from edge.config import EdgeConfig
from edge.openai.responses.items import item_id
from edge.openai.responses.schema import ResponsesRequest
from edge.openai.schema import ErrorReply, error_reply


def event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) \
        + b"\n\n"


class ResponsesSink:
    def __init__(self, config: EdgeConfig, req: ResponsesRequest, max_pending: int,
                 on_overflow: Callable[[], None], response_id: str | None = None, created_at: int | None = None,
                 on_close: Callable[[ResponsesSink], None] | None = None) -> None:
        self.model = config.model
        self.req = req
        self.max_pending = max_pending
        self.on_overflow = on_overflow
        # A replay (another edge rebuilding this response from the reply topic, edge.admission.replay)
        # passes the stored id and creation time: with the item ids derived from the response id
        # (_new_id), the same tokens give the same events, byte for byte, on every edge.
        self.id = response_id if response_id is not None else item_id("resp_")
        self.created_at = created_at if created_at is not None else int(time.time())
        self.on_close = on_close  # called once, when the response ended (the edge stores the final object)
        self._items = 0
        self.muted = False
        self.stream: Stream | None = None
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: ErrorReply | None = None
        self.pending: list[bytes] = []
        self.closed = False
        self.started = False  # the first output (a token, the end or an error) has arrived
        self._seq = 0
        self._wake = asyncio.Event()
        self._msg: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # ToolStream call index -> its function_call item
        tr = req.chat.tools
        self.tools = ToolStream(configured_parser(
            config.tool_call_parser, config.model, config.model_path)) if tr is not None and tr.active else None
        parser = config.reasoning_parser  # --reasoning-parser: <think>...</think> -> a reasoning item
        self.reasoning = ReasoningStream(parser) if parser is not None else None
        self._think: dict[str, Any] | None = None  # the open reasoning item
        self.reasoning_tokens = 0  # output tokens of chunks that ended inside the reasoning

    # --- events -------------------------------------------------------------------------------
    def _new_id(self, prefix: str) -> str:
        """The next output item's id: a function of the response id and the item's rank, so a replay
        names every item as the first run did."""
        self._items += 1
        return f"{prefix}{self.id.removeprefix('resp_')}{self._items:04x}"

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.req.stream:
            if not self.muted:
                self.pending.append(event(kind, self._seq, **fields))
            self._seq += 1

    def mute(self) -> None:
        """No reader any more (a background response's client went away; it runs on, and is read
        back from the bus by whoever resumes it): events are numbered but not kept."""
        self.muted = True
        self.pending = []

    def bind(self, s: Stream) -> None:
        self.stream = s
        self._emit("response.created", response=self.response())
        self._emit("response.in_progress", response=self.response())

    def _open_message(self) -> dict[str, Any]:
        if self._msg is None:
            self._msg = {"id": self._new_id("msg_"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.output.append(self._msg)
            i = len(self.output) - 1
            self._emit("response.output_item.added", output_index=i,
                       item={**self._msg, "content": []})
            self._emit("response.content_part.added", item_id=self._msg["id"], output_index=i, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})
        return self._msg

    def _close_message(self) -> None:
        m, self._msg = self._msg, None
        if m is None:
            return
        i, part = self.output.index(m), m["content"][0]
        m["status"] = "completed"
        self._emit("response.output_text.done", item_id=m["id"], output_index=i, content_index=0,
                   text=part["text"], logprobs=[])
        self._emit("response.content_part.done", item_id=m["id"], output_index=i, content_index=0, part=part)
        self._emit("response.output_item.done", output_index=i, item=m)

    def _reason(self, text: str) -> None:
        if self._think is None:
            self._think = {"id": self._new_id("rs_"), "type": "reasoning", "status": "in_progress",
                           "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self._think)
            self._emit("response.output_item.added", output_index=len(self.output) - 1,
                       item={**self._think, "content": []})
        self._think["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", item_id=self._think["id"],
                   output_index=self.output.index(self._think), content_index=0, delta=text)

    def _close_reasoning(self) -> None:
        t, self._think = self._think, None
        if t is None:
            return
        i = self.output.index(t)
        t["status"] = "completed"
        self._emit("response.reasoning_text.done", item_id=t["id"], output_index=i, content_index=0,
                   text=t["content"][0]["text"])
        self._emit("response.output_item.done", output_index=i, item=t)

    def _part(self, kind: str, text: str) -> None:
        if kind == REASONING:
            self._reason(text)
        else:
            self._answer(text)

    def _answer(self, text: str) -> None:
        for d in self.tools.feed(text) if self.tools is not None else [{"content": text}]:
            self._apply(d)

    def _apply(self, delta: dict[str, Any]) -> None:
        if delta.get("content") or delta.get("tool_calls"):
            self._close_reasoning()
        text = delta.get("content")
        if text:
            m = self._open_message()
            m["content"][0]["text"] += text
            self._emit("response.output_text.delta", item_id=m["id"], output_index=self.output.index(m),
                       content_index=0, delta=text, logprobs=[])
        for tc in delta.get("tool_calls") or ():
            k = tc["index"]
            if k > 0 and not self.req.parallel_tool_calls:
                continue  # parallel_tool_calls false: the first call only
            if "id" in tc:  # a new call
                self._close_message()
                new = {"id": self._new_id("fc_"), "type": "function_call", "status": "in_progress",
                       "call_id": self._new_id("call_"), "name": tc["function"]["name"], "arguments": ""}
                self._calls[k] = new
                self.output.append(new)
                self._emit("response.output_item.added", output_index=len(self.output) - 1, item=dict(new))
            frag = tc.get("function", {}).get("arguments") or ""
            call = self._calls.get(k)
            if frag and call is not None:
                call["arguments"] += frag
                self._emit("response.function_call_arguments.delta", item_id=call["id"],
                           output_index=self.output.index(call), delta=frag)

    # --- the sink: lifecycle events -> items and events ----------------------------------------
    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...],  # noqa: ARG002 - the sink's signature
                 logprobs: tuple | None) -> bool:  # noqa: ARG002
        self.started = True
        if self.reasoning is None:
            self._answer(text)
        else:
            for kind, part in self.reasoning.feed(text):
                self._part(kind, part)
            if self.reasoning.in_reasoning:
                self.reasoning_tokens += len(token_ids)
        self._wake.set()
        if len(self.pending) > self.max_pending:
            self.on_overflow()
            if self.req.background:  # the response runs on; its client resumes from the bus
                self.mute()
                return True
            return False  # the lifecycle fails the stream; on_end emits response.failed
        return True

    def on_end(self, s: Stream, end: End) -> None:
        self.started = True
        if self.closed:
            return
        if isinstance(end, Done):
            self._done(s, end)
        elif isinstance(end, Failed):
            self.error = error_reply(end.code, end.message, end.retry_after)
            self.status = "failed"
            self._emit("response.failed", response={**self.response(), "error": {"code": end.code,
                                                                                 "message": end.message}})
        else:  # Cancelled: by POST .../cancel, or the handler is leaving; nothing more is written
            self.status = "cancelled"
        self.closed = True
        self._wake.set()
        if self.on_close is not None:
            self.on_close(self)

    def _done(self, s: Stream, end: Done) -> None:
        out = end.completion_tokens
        self.usage = {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
                      "output_tokens": out, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": s.prompt_tokens + out}
        for kind, part in self.reasoning.finish() if self.reasoning is not None else ():
            self._part(kind, part)
        for d in self.tools.finish() if self.tools is not None else ():
            self._apply(d)
        self._close_reasoning()
        self._close_message()
        for item in self._calls.values():
            item["status"] = "completed"
            i = self.output.index(item)
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                       name=item["name"], arguments=item["arguments"])
            self._emit("response.output_item.done", output_index=i, item=item)
        if end.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif end.finish_reason == "abort":  # cancelled (POST .../cancel on any edge): the worker stopped it
            self.status, self.incomplete = "cancelled", {"reason": "cancelled"}
        else:
            self.status = "completed"
        self._emit("response.incomplete" if self.incomplete else "response.completed", response=self.response())

    # --- the handler's side -------------------------------------------------------------------
    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def take(self) -> bytes:
        out, self.pending = self.pending, []
        return b"".join(out)

    def take_after(self, seq: int) -> bytes:
        """The pending events whose ``sequence_number`` is above ``seq`` (a resume's
        ``starting_after``); the others are dropped. Pending events are numbered consecutively up
        to the last one emitted."""
        out, self.pending = self.pending, []
        first = self._seq - len(out)
        return b"".join(out[max(0, seq + 1 - first):])

    def response(self) -> dict[str, Any]:
        """The ``response`` object as it stands (final once ``closed``)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "error": None, "incomplete_details": self.incomplete, "model": self.model,
                "output": [dict(o) for o in self.output], "usage": self.usage, "background": self.req.background,
                **self.req.echo}
