"""``/v1/responses``: create (streamed and not, in the foreground or ``background``), ``GET`` (the
response, or with ``stream=true&starting_after=N`` its events after N, then live), ``DELETE``, its
``input_items`` (:mod:`edge.openai.responses.items`) and ``cancel``, on whichever edge of the fleet
the call lands (docs/protocol.md, "Resuming a stream").

A request runs as the chat request it translates into (:mod:`edge.openai.responses.schema`): the
same tool prompt and forcing grammar (:func:`edge.chat.tools.prepare`), the same
:meth:`~edge.admission.gate.Admission.admit` (keys, tiers, limits, shedding, ``api="openai"`` metrics),
the same bus path and exact resume; only the sink differs (:mod:`edge.openai.responses.sink`).

A foreground request belongs to its handler: a client that goes away cancels it (aiohttp's handler
cancellation ends the handler's ``with adm.streams()`` block). A ``background`` one belongs to the
routes' own owner, which is never left: it runs on without its client, and an edge that stops (or
dies) leaves it running for another edge to read. What any edge needs to answer for a stored
response is on the bus (:mod:`edge.openai.responses.store`: the record; :mod:`edge.admission.replay`:
its output from the reply topic); the edge that admitted it answers ``GET`` from its own sink while
it runs (no bus read), every other edge by a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from bus import BusError, ErrorCode
from edge.admission.auth import Principal
from edge.admission.gate import Admission, Admitted
from edge.admission.replay import Replay, ReplyOrigin, detached_stream, snapshot
from edge.chat.tool_parsers import configured_parser
from edge.chat.tools import prepare
from edge.http import SSE_HEADERS
from edge.openai.reply import API, authed_json, caller, error_response, failed_response, json_response, refusal
from edge.openai.responses.items import page
from edge.openai.responses.schema import ResponsesRequest, parse_responses
from edge.openai.responses.sink import ResponsesSink
from edge.openai.responses.store import ResponseStore, StoredResponse
from edge.openai.schema import openai_param
from edge.request import ProtocolError

log = logging.getLogger(__name__)

FINALS_QUEUE = 4096  # background responses ended, waiting for their final record to be written
NO_LIMIT = 1 << 62  # a replay's sink: its reader paces the replay, nothing piles up


def output_history(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat turns a follow-up continues from."""
    msgs: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            msgs.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return msgs


def owner_of(who: Principal) -> str:
    """Who may read a stored response: the API key that made it (its hash; dev mode: one shared)."""
    return who.entry.key_hash


class ResponsesRoutes:
    def __init__(self, adm: Admission, store: ResponseStore) -> None:
        self.adm = adm
        self.store = store
        # background responses: owned here, never left (they outlive their handlers and the edge's stop)
        self._background = adm.streams()
        # this edge's stored responses in flight, by response id: GET answers from the sink (no replay)
        self._running: dict[str, tuple[StoredResponse, ResponsesSink]] = {}
        self._finals: asyncio.Queue[StoredResponse] = asyncio.Queue(FINALS_QUEUE)
        self._writer: asyncio.Task[None] | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_get("/v1/responses/{id}/input_items", self.list_input_items)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)

    # --- owned task: the final records of background responses ----------------------------------
    async def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_finals(), name="responses-finals")

    async def stop(self) -> None:
        """Stop writing; background responses still running are left to the fleet (not cancelled):
        whichever edge reads one to its end writes its final record."""
        for _, sink in self._running.values():
            sink.mute()
        task, self._writer = self._writer, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _write_finals(self) -> None:
        while True:
            r = await self._finals.get()
            await self._put(r)

    def _closed(self, sink: ResponsesSink) -> None:
        """A background response ended here (its sink's ``on_close``): its final record is queued."""
        got = self._running.pop(sink.id, None)
        if got is not None:
            try:
                self._finals.put_nowait(self._final(got[0], sink))
            except asyncio.QueueFull:  # a later GET replays it to its end and writes it then
                log.warning("final-record queue full: response %s stays in_progress on the bus", sink.id)

    async def _put(self, r: StoredResponse) -> bool:
        try:
            async with asyncio.timeout(self.adm.config.publish_timeout_s):
                await self.store.put(r)
            return True
        except (BusError, TimeoutError, ValueError) as exc:
            log.warning("storing response %s failed: %s", r.id, exc)
            return False

    def _final(self, entry: StoredResponse, sink: ResponsesSink) -> StoredResponse:
        return entry.ended(sink.response(), sink.req.history + tuple(output_history(sink.output)),
                           sink.req.input_items)

    # --- helpers --------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> Principal | web.Response:
        return caller(self.adm, request)

    def _missing(self, rid: str, param: str | None = None) -> web.Response:
        self.adm.reject("not_found", API)
        return error_response("not_found", f"no stored response with id {rid[:100]!r}", param)

    async def _lookup(self, who: Principal, rid: str) -> StoredResponse | web.Response:
        """The stored response ``rid`` of ``who``'s key, else the 404 of an unknown id."""
        try:
            got = await self.store.get(owner_of(who), rid)
        except BusError as exc:
            self.adm.reject("overloaded", API)
            return error_response("overloaded", f"the response store is unreachable: {exc}", None, 1.0)
        return got if got is not None else self._missing(rid)

    def _rebuild(self, entry: StoredResponse, stream: bool) -> ResponsesSink:
        """A sink for ``entry`` as the admitting edge built it, bound to a detached stream."""
        encoder = self.adm.encoder
        assert encoder is not None
        req = parse_responses(entry.body, encoder.context_len, entry.previous)
        sink = ResponsesSink(self.adm.config, replace(req, stream=stream), NO_LIMIT, lambda: None,
                             response_id=entry.id, created_at=entry.created_at)
        sink.bind(detached_stream(entry.origin.request_id, sink, entry.prompt_tokens))
        return sink

    async def _current(self, entry: StoredResponse) -> ResponsesSink:
        """``entry``'s output as it stands: this edge's own sink, else a snapshot replay (whose end,
        when it has one, is stored: the first edge to see the end of a response writes it)."""
        local = self._running.get(entry.id)
        if local is not None:
            return local[1]
        sink = self._rebuild(entry, stream=False)
        assert sink.stream is not None
        end = await snapshot(self.adm.bus, entry.origin, sink.stream, self.adm.config.publish_timeout_s * 2)
        if end is not None and not entry.final:
            await self._put(self._final(entry, sink))
        return sink

    # --- GET / DELETE / input_items / cancel --------------------------------------------------
    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        entry = await self._lookup(who, request.match_info["id"])
        if isinstance(entry, web.Response):
            return entry
        q = request.query
        if q.get("stream", "false").lower() in ("true", "1"):
            raw = q.get("starting_after", "-1")
            try:
                after = int(raw)
            except ValueError:
                return refusal(self.adm, ProtocolError(f"starting_after must be an integer, got {raw[:40]!r}",
                                                       "starting_after"))
            return await self._resume(request, entry, after)
        if entry.response is not None:
            return json_response(200, entry.response)
        try:
            return json_response(200, (await self._current(entry)).response())
        except (TimeoutError, BusError) as exc:
            self.adm.reject("overloaded", API)
            return error_response("overloaded", f"the response's replies could not be read: {exc}", None, 1.0)

    async def _resume(self, request: web.Request, entry: StoredResponse, after: int) -> web.StreamResponse:
        """Replay ``entry``'s events after ``after`` from the reply topic, then follow it live to its end."""
        sink = self._rebuild(entry, stream=True)
        assert sink.stream is not None
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.adm.config.request_timeout_s
        try:
            async with Replay(self.adm.bus, entry.origin, sink.stream) as r:
                live = not entry.final
                while True:
                    more = await r.advance(live=live)
                    data = sink.take_after(after)
                    if data:
                        await resp.write(data)
                    if not more or loop.time() > deadline:
                        break
            if r.ended is not None and not entry.final:
                await self._put(self._final(entry, sink))
            await resp.write_eof()
        except ConnectionError:  # the reader went away: reading never stops a response
            pass
        return resp

    async def list_input_items(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        entry = await self._lookup(who, request.match_info["id"])
        if isinstance(entry, web.Response):
            return entry
        items = entry.input_items if entry.final else self._rebuild(entry, stream=False).req.input_items
        try:
            return json_response(200, page(items, request.query))
        except ProtocolError as exc:
            return refusal(self.adm, exc)

    async def delete(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        rid = request.match_info["id"]
        try:
            if not await self.store.delete(owner_of(who), rid):
                return self._missing(rid)
        except BusError as exc:
            self.adm.reject("overloaded", API)
            return error_response("overloaded", f"the response store is unreachable: {exc}", None, 1.0)
        return json_response(200, {"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """Stop a background response, whichever edge admitted it: its stream here if it runs here,
        else a ``Cancel`` for the workers; the response as it stood, ``status: cancelled``, is stored."""
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        entry = await self._lookup(who, request.match_info["id"])
        if isinstance(entry, web.Response):
            return entry
        if not entry.background:
            self.adm.reject("invalid_request", API)
            return error_response("invalid_request", "only background responses can be cancelled")
        if entry.response is not None:
            return json_response(200, entry.response)
        local = self._running.get(entry.id)
        s = self.adm.lifecycle.get(entry.origin.request_id)
        if s is not None:
            self.adm.lifecycle.cancel(s, "client")  # its sink closes: the final record is queued
        else:
            self.adm.publish_cancel(entry.origin.request_id, "client")
        if local is not None:
            sink = local[1]
        else:
            try:
                sink = await self._current(entry)
            except (TimeoutError, BusError):
                sink = self._rebuild(entry, stream=False)  # the output so far is unknown: none
        sink.status = "cancelled"
        final = self._final(entry, sink)
        await self._put(final)
        assert final.response is not None
        return json_response(200, final.response)

    # --- create ---------------------------------------------------------------------------------
    async def _previous(self, who: Principal, prev_id: str) -> tuple[dict[str, Any], ...] | web.Response:
        entry = await self._lookup(who, prev_id)
        if isinstance(entry, web.Response):
            if entry.status == 404:
                return self._missing(prev_id, "previous_response_id")
            return entry
        if entry.final:
            return entry.history
        sink = await self._current(entry)
        if not sink.closed:
            self.adm.reject("invalid_request", API)
            return error_response("invalid_request", f"the response {prev_id[:100]!r} is still in progress",
                                  "previous_response_id")
        return sink.req.history + tuple(output_history(sink.output))

    async def create(self, request: web.Request) -> web.StreamResponse:
        call = await authed_json(self.adm, request)
        if isinstance(call, web.Response):
            return call
        return await self.answer(call.body, call.who, request)

    async def answer(self, body: Any, who: Principal, request: web.Request | None = None) -> web.StreamResponse:
        """One Responses request from its decoded body: what ``POST`` answers. Without
        ``request`` (a batch line) nothing is streamed (the caller refuses ``stream``)."""
        adm = self.adm
        encoder = adm.encoder
        assert encoder is not None
        previous: tuple[dict[str, Any], ...] = ()
        try:
            prev_id = body.get("previous_response_id") if isinstance(body, dict) else None
            if isinstance(prev_id, str):
                got = await self._previous(who, prev_id)
                if isinstance(got, web.Response):
                    return got
                previous = got
            req = parse_responses(body, encoder.context_len, previous)
            model = req.chat.generate.model or ""
            encoder = await adm.encoder_for(model)  # a base model or an adapter of one: docs/lora.md (404 else)
            if req.chat.tools is not None:
                g = await asyncio.to_thread(prepare, req.chat.generate, req.chat.tools, encoder, configured_parser(
                    adm.config.tool_call_parser, adm.config.model, adm.config.model_path))
                req = replace(req, chat=replace(req.chat, generate=g))
        except ProtocolError as exc:
            return refusal(adm, exc)
        transport = request.transport if request is not None else None
        sink = ResponsesSink(adm.config, req, adm.config.send_queue_frames,
                             on_overflow=lambda: transport.abort() if transport is not None else None,
                             on_close=self._closed if req.background else None)
        # a background response is owned here, not by the handler: its client may go
        owned = self._background if req.background else adm.streams()
        with contextlib.nullcontext(owned) if req.background else owned:
            try:
                admitted = await adm.admit(req.chat.generate, who, sink, API, owned, client_id="",
                                           trace_parent=adm.trace_parent(request.headers) if request else None)
            except ProtocolError as exc:
                return refusal(adm, exc, openai_param(exc.field, body, "text", "text.format", guided_fields=False))
            assert admitted is not None
            sink.bind(admitted.stream)
            entry = self._entry(who, req, body, previous, sink, admitted) if req.store else None
            if entry is not None and not self.store.fits(entry):
                if req.background:
                    adm.lifecycle.fail(admitted.stream, ErrorCode.INVALID_REQUEST, "too large to store")
                    return refusal(adm, ProtocolError(
                        f"the request is too large to store (over --responses-max-bytes "
                        f"{self.store.table.max_value_bytes}), and a background response must be stored",
                        "background"))
                entry = None  # not stored: no follow-up turn, no resume
            if not await self._publish(admitted, entry, req.background):
                assert sink.error is not None
                return failed_response(sink.error)
            if entry is not None and not sink.closed:
                self._running[sink.id] = (entry, sink)
            try:
                if req.stream:
                    assert request is not None, "a batch line never streams"
                    return await self._stream(request, sink, entry)
                if req.background:
                    return json_response(200, sink.response())
                while not sink.closed:
                    await sink.wait()
                if sink.error is not None:
                    return failed_response(sink.error)
                await self._keep(entry, sink)
                return json_response(200, sink.response())
            finally:
                if not req.background:  # a foreground response ends with its handler
                    self._running.pop(sink.id, None)

    def _entry(self, who: Principal, req: ResponsesRequest, body: dict[str, Any],
               previous: tuple[dict[str, Any], ...], sink: ResponsesSink, a: Admitted) -> StoredResponse:
        # The replies start after the admission (the worker stamps them later): reading the reply
        # topic from now (less the allowed clock skew, edge.admission.replay) finds all of them.
        origin = ReplyOrigin(a.request.request_id, a.request.reply_to, int(time.time() * 1000))
        return StoredResponse(sink.id, owner_of(who), "in_progress", sink.created_at, req.background, origin,
                              a.stream.prompt_tokens, body, previous)

    async def _publish(self, admitted: Admitted, entry: StoredResponse | None, background: bool) -> bool:
        """The request on its topic and, for a stored response, its record in the table, both
        before the client hears of it. A background response whose record could not be written is
        failed (no edge could find it): ``overloaded``, and a Cancel for the workers."""
        if entry is None:
            return await self.adm.publish(admitted)
        put = asyncio.ensure_future(self._put(entry))
        try:
            ok = await self.adm.publish(admitted)
        finally:
            stored = await put
        if ok and not stored and background:
            self.adm.lifecycle.fail(admitted.stream, ErrorCode.OVERLOADED, "the response could not be stored "
                                    "on the bus; retry", 1.0, cancel="unstored")
            return False
        return ok

    async def _keep(self, entry: StoredResponse | None, sink: ResponsesSink) -> None:
        """A foreground response ended: its final record is written before the client hears the
        end, so a follow-up turn on any edge finds it."""
        if entry is not None:
            self._running.pop(sink.id, None)
            if sink.error is None:
                await self._put(self._final(entry, sink))

    async def _stream(self, request: web.Request, sink: ResponsesSink,
                      entry: StoredResponse | None) -> web.StreamResponse:
        # written to the bus before the 200 goes out (as on chat): a request the bus did not take
        # is a plain error status, never a 200 stream
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        try:
            await resp.prepare(request)
            # response.created / in_progress leave with the first output, not before prefill: the
            # first event's arrival is the TTFT clients measure (docs/protocol.md, "Streaming")
            while not sink.started:
                await sink.wait()
            while True:
                if not sink.pending and not sink.closed:
                    await sink.wait()
                data = sink.take()
                if data:
                    await resp.write(data)
                if sink.closed and not sink.pending:
                    break
            if not sink.req.background:
                await self._keep(entry, sink)
            await resp.write_eof()
        except ConnectionError:  # the client went away (or was cut off as too slow): the caller cancels
            pass
        finally:
            if sink.req.background and not sink.closed:
                sink.mute()  # runs on without this client; it resumes from the bus
        return resp
