"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Served on the OpenAI API's port (the edge adds these routes to that application, so one
``base_url`` serves both SDKs), through the same admission as every other request: the key and
its tier, the rate limits and stream slots, shedding, the bus topic of the tier, the reply
router and the one stream lifecycle (metrics labelled ``api="anthropic"``). Tools go through the
chat path's prompt and forcing grammar (:func:`edge.chat.tools.prepare`). See docs/protocol.md,
"Anthropic Messages API".

Client disconnect: as on the OpenAI routes, aiohttp cancels the handler of a client that went
away, and leaving its ``with adm.streams()`` block cancels the request (reason ``disconnect``).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from aiohttp import web

from edge.admission.auth import AuthError
from edge.admission.gate import Admission
from edge.anthropic.errors import API, error_reply
from edge.anthropic.reply import error_response, json_response, principal, read_json, refusal
from edge.anthropic.schema import MessagesRequest, parse_messages
from edge.anthropic.sink import MessagesSink
from edge.chat.tool_parsers import configured_parser
from edge.chat.tools import prepare
from edge.http import SSE_HEADERS
from edge.request import Generate, PromptEncoder, ProtocolError


class MessagesRoutes:
    """The Messages API's handlers, added to the edge's HTTP application."""

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        cfg = adm.config
        self.parser = configured_parser(cfg.tool_call_parser, cfg.model, cfg.model_path)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def _parse(self, request: web.Request, count_only: bool) -> tuple[MessagesRequest, PromptEncoder]:
        """The body as a request whose prompt is ready for admission: checked, the model served,
        tool turns rendered with the tools (and a forced choice's grammar)."""
        adm = self.adm
        req = parse_messages(await read_json(adm, request), count_only)
        # a base model of this edge or a LoRA adapter of one, as on the OpenAI routes (docs/lora.md);
        # 404 ``not_found_error`` for any other name
        encoder = await adm.encoder_for(req.generate.model or "")
        if req.tools is not None:
            g = await asyncio.to_thread(prepare, req.generate, req.tools, encoder, self.parser)
            req = replace(req, generate=g)
        return req, encoder

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``{"input_tokens": N}``: the prompt's tokens as ``/v1/messages`` would send them (tools
        included). Nothing goes to the bus: the edge holds the tokenizer."""
        adm = self.adm
        try:
            principal(adm, request)
        except AuthError as exc:
            adm.reject("unauthorized", API)
            return error_response(error_reply("unauthorized", str(exc)))
        try:
            parsed, encoder = await self._parse(request, count_only=True)
            g: Generate = parsed.generate
            ids = g.prompt_token_ids if g.prompt_token_ids is not None else await asyncio.to_thread(encoder.encode, g)
        except ProtocolError as exc:
            return refusal(adm, exc)
        return json_response(200, {"input_tokens": len(ids)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        adm = self.adm
        try:
            who = principal(adm, request)
        except AuthError as exc:
            adm.reject("unauthorized", API)
            return error_response(error_reply("unauthorized", str(exc)))
        try:
            req, encoder = await self._parse(request, count_only=False)
        except ProtocolError as exc:
            return refusal(adm, exc)
        wake = asyncio.Event()
        transport = request.transport
        cfg = adm.config
        # the answer names the model asked for: the base model or an adapter (as the OpenAI routes)
        sink = MessagesSink(req.generate.model or cfg.model, req, self.parser, cfg.reasoning_parser,
                            frozenset(encoder.tokenizer.all_special_ids), cfg.send_queue_frames,
                            on_overflow=lambda: transport.abort() if transport is not None else None, wake=wake)
        with adm.streams() as owned:
            try:
                a = await adm.admit(req.generate, who, sink, API, owned, client_id="",
                                    trace_parent=adm.trace_parent(request.headers))
            except ProtocolError as exc:
                if exc.field is not None and exc.field.startswith("guided_"):
                    exc.field = "tool_choice"  # the only output constraint this API sets
                return refusal(adm, exc)
            assert a is not None
            sink.bind(a.stream)
            # written to the bus before any answer: a request the bus did not take is a plain
            # error status (529 with the bus down), never a 200 stream that ends in an error event
            if not await adm.publish(a):
                assert sink.error is not None
                return error_response(sink.error)
            if req.stream:
                return await self._stream(request, sink, wake)
            while not sink.closed:
                await wake.wait()
                wake.clear()
            if sink.error is not None:
                return error_response(sink.error)
            return json_response(200, sink.response())

    async def _stream(self, request: web.Request, sink: MessagesSink, wake: asyncio.Event) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            # message_start leaves with the first output, not before prefill: TTFT as clients read
            # it is the first event's arrival (docs/protocol.md, "Streaming")
            while not sink.started:
                await wake.wait()
                wake.clear()
            head = sink.head()
            while True:
                data = head + sink.take()
                head = b""
                if data:
                    await resp.write(data)
                if sink.closed:
                    break
                await wake.wait()
                wake.clear()
            await resp.write_eof()
        except ConnectionError:  # the client went away (or was cut off as too slow): the caller cancels
            pass
        return resp
