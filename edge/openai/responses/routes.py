"""``/v1/responses``: create (streamed and not), ``GET`` and ``DELETE`` of a stored response, its
``input_items`` (:mod:`edge.openai.responses.items`), and ``cancel`` (refused: this server runs no
background responses).

A request runs as the chat request it translates into (:mod:`edge.openai.responses.schema`): the
same tool prompt and forcing grammar (:func:`edge.chat.tools.prepare`), the same
:meth:`~edge.admission.gate.Admission.admit` (keys, tiers, limits, shedding, ``api="openai"`` metrics),
the same bus path and exact resume; only the sink differs (:mod:`edge.openai.responses.sink`).
A client that goes away cancels its request as on chat (aiohttp's handler cancellation ends the
handler's ``with adm.streams()`` block).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from aiohttp import web

from edge.admission.auth import AuthError, Principal
from edge.admission.gate import Admission, Admitted
from edge.chat.tool_parsers import configured_parser
from edge.chat.tools import prepare
from edge.openai.reply import API, error_response, failed_response, json_response, principal, read_json, refusal
from edge.openai.responses.items import page
from edge.openai.responses.schema import ResponsesRequest, parse_responses
from edge.openai.responses.sink import ResponsesSink
from edge.openai.responses.store import ResponseStore
from edge.openai.schema import openai_param
from edge.request import ProtocolError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


class ResponsesRoutes:
    def __init__(self, adm: Admission, store: ResponseStore | None = None) -> None:
        self.adm = adm
        self.store = store if store is not None else ResponseStore()

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_get("/v1/responses/{id}/input_items", self.list_input_items)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)

    def _auth(self, request: web.Request) -> Principal | web.Response:
        try:
            return principal(self.adm, request)
        except AuthError as exc:
            self.adm.reject("unauthorized", API)
            return error_response("unauthorized", str(exc))

    def _missing(self, rid: str, param: str | None = None) -> web.Response:
        self.adm.reject("not_found", API)
        return error_response("not_found", f"no stored response with id {rid[:100]!r}", param)

    async def retrieve(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        got = self.store.get(who.tenant, request.match_info["id"])
        return json_response(200, got.response) if got is not None else self._missing(request.match_info["id"])

    async def list_input_items(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        rid = request.match_info["id"]
        got = self.store.get(who.tenant, rid)
        if got is None:
            return self._missing(rid)
        try:
            return json_response(200, page(got.input_items, request.query))
        except ProtocolError as exc:
            return refusal(self.adm, exc)

    async def delete(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        rid = request.match_info["id"]
        if not self.store.delete(who.tenant, rid):
            return self._missing(rid)
        return json_response(200, {"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        rid = request.match_info["id"]
        if self.store.get(who.tenant, rid) is None:
            return self._missing(rid)
        self.adm.reject("invalid_request", API)
        return error_response("invalid_request", "only background responses can be cancelled, and this server "
                              "runs none (background is refused): this response has already finished")

    async def create(self, request: web.Request) -> web.StreamResponse:
        adm = self.adm
        who = self._auth(request)
        if isinstance(who, web.Response):
            return who
        try:
            body = await read_json(adm, request)
        except ProtocolError as exc:
            return refusal(adm, exc)
        return await self.answer(body, who, request)

    async def answer(self, body: Any, who: Principal, request: web.Request | None = None) -> web.StreamResponse:
        """One Responses request from its decoded body: what ``POST`` answers. Without
        ``request`` (a batch line) nothing is streamed (the caller refuses ``stream``)."""
        adm = self.adm
        encoder = adm.encoder
        assert encoder is not None
        try:
            previous: tuple[dict[str, Any], ...] = ()
            prev_id = body.get("previous_response_id") if isinstance(body, dict) else None
            if isinstance(prev_id, str):
                got = self.store.get(who.tenant, prev_id)
                if got is None:
                    return self._missing(prev_id, "previous_response_id")
                previous = got.history
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
                             on_overflow=lambda: transport.abort() if transport is not None else None)
        with adm.streams() as owned:  # leaving it (the client gone, a failed write) cancels the request
            try:
                admitted = await adm.admit(req.chat.generate, who, sink, API, owned, client_id="",
                                           trace_parent=adm.trace_parent(request.headers) if request else None)
            except ProtocolError as exc:
                return refusal(adm, exc, openai_param(exc.field, body, "text", "text.format", guided_fields=False))
            assert admitted is not None
            sink.bind(admitted.stream)
            if req.stream:
                assert request is not None, "a batch line never streams"
                return await self._stream(request, sink, admitted, who, req)
            await adm.publish(admitted)
            while not sink.closed:
                await sink.wait()
            if sink.error is not None:
                return failed_response(sink.error)
            self._keep(who, req, sink)
            return json_response(200, sink.response())

    def _keep(self, who: Principal, req: ResponsesRequest, sink: ResponsesSink) -> None:
        if req.store and sink.error is None:
            self.store.put(who.tenant, sink.response(), req.history + tuple(output_history(sink.output)),
                           req.input_items)

    async def _stream(self, request: web.Request, sink: ResponsesSink, admitted: Admitted, who: Principal,
                      req: ResponsesRequest) -> web.StreamResponse:
        # written to the bus before the 200 goes out (as on chat): a request the bus did not take
        # is a plain error status, never a 200 stream
        if not await self.adm.publish(admitted):
            assert sink.error is not None
            return failed_response(sink.error)
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
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
            self._keep(who, req, sink)
            await resp.write_eof()
        except ConnectionError:  # the client went away (or was cut off as too slow): the caller cancels
            pass
        return resp
