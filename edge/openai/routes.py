"""The OpenAI-compatible HTTP API (aiohttp), on its own port next to the WebSocket listener.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``; and, from their own modules, ``/v1/files`` and ``/v1/batches``
(:mod:`edge.openai.batches`), ``/tokenize`` ``/detokenize``
(:mod:`edge.openai.tokenize`), ``GET /v1/chat/completions/{id}`` (:mod:`edge.openai.resume`), ``/v1/responses`` (:mod:`edge.openai.responses`), ``/v1/embeddings``
(:mod:`edge.openai.embeddings`) and the probes ``/health`` ``/ready`` ``/metrics`` ``/version``
(:mod:`edge.openai.ops`). Admission is the WebSocket path's own (:class:`~edge.admission.gate.Admission`,
metrics labelled ``api="openai"``); the request's :class:`~edge.openai.stream.OpenAIStream` is its
reply sink.

Client disconnect: the runner is built with ``handler_cancellation=True``, so aiohttp cancels a
handler whose client went away, whether it is waiting for the first token, for a non-streamed
answer or writing a stream; leaving its ``with adm.streams()`` block then has the stream lifecycle
cancel the request (reason ``disconnect``), as for a closed WebSocket; a ``"resumable": true``
stream is owned by the admission's ``resumables`` instead and runs on (:mod:`edge.openai.resume`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from edge.admission.auth import AuthError, Principal
from edge.admission.gate import Admission, Admitted
from edge.chat.tool_parsers import configured_parser
from edge.chat.tools import prepare
from edge.http import SSE_HEADERS
from edge.openai.batches.routes import BatchService
from edge.openai.embeddings import EmbeddingsRoutes
from edge.openai.lora_admin import LoraAdminRoutes
from edge.openai.ops import OpsRoutes, Readiness
from edge.openai.reply import (
    API,
    authed_json,
    error_response,
    failed_response,
    json_response,
    principal,
    refusal,
)
from edge.openai.responses.routes import ResponsesRoutes
from edge.openai.responses.store import ResponseStore
from edge.openai.resume import RESUME_HEADER, ChatResumeRoutes, record, resumable
from edge.openai.schema import OpenAIRequest, openai_param, parse_chat, parse_completion
from edge.openai.stream import DONE, OpenAIStream, merged_response, merged_usage, sse
from edge.openai.tokenize import TokenizeRoutes
from edge.request import Generate, PromptEncoder, ProtocolError

log = logging.getLogger(__name__)



def _echo(req: OpenAIRequest, g: Generate, encoder: PromptEncoder) -> str:
    """Completions' ``echo``: the prompt's text (a token-id prompt decoded), else nothing."""
    if not req.echo:
        return ""
    return g.prompt if g.prompt is not None else str(encoder.tokenizer.decode(list(g.prompt_token_ids or ())))


class OpenAIServer:
    """The aiohttp application and its listener. ``start()``/``stop()`` are called by the edge."""

    def __init__(self, adm: Admission, host: str, port: int, responses: ResponseStore,
                 readiness: Readiness = lambda: (True, "ready: no readiness check wired")) -> None:
        self.adm = adm
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        app = web.Application(client_max_size=adm.config.max_frame_bytes)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        # routes of their own modules (one concept each), sharing this app and its admission
        TokenizeRoutes(adm).add_to(app)
        OpsRoutes(adm, readiness).add_to(app)
        self.responses = ResponsesRoutes(adm, responses)
        embeddings = EmbeddingsRoutes(adm)
        embeddings.add_to(app)
        LoraAdminRoutes(adm).add_to(app)
        self.responses.add_to(app)
        ChatResumeRoutes(adm).add_to(app)
        # the Files and Batches API: a batch line runs through the same ``answer`` as its endpoint
        self.batches = BatchService(adm, {
            "/v1/chat/completions": lambda body, who: self.answer(body, who, True),
            "/v1/completions": lambda body, who: self.answer(body, who, False),
            "/v1/embeddings": embeddings.answer,
            "/v1/responses": self.responses.answer,
        })
        self.batches.add_to(app)
        self.app = app

    async def start(self) -> None:
        await self.responses.start()
        await self.batches.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port, backlog=4096,
                                 reuse_port=self.adm.config.reuse_port or None)
        await self._site.start()
        sockets = getattr(self._site._server, "sockets", None)  # the bound port, for port 0
        if sockets:
            self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.batches.stop()  # after the handlers: the runner's lines are cancelled on the bus
        await self.responses.stop()

    # --- handlers -----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        try:
            principal(self.adm, request)
        except AuthError as exc:
            self.adm.reject("unauthorized", API)
            return error_response("unauthorized", str(exc))
        served = self._served()
        # Anthropic's list fields too (the anthropic SDK's models.list reads this same route)
        first, last = (served[0]["id"], served[-1]["id"]) if served else (None, None)
        return json_response(200, {"object": "list", "data": served, "has_more": False, "first_id": first,
                                   "last_id": last})

    async def model(self, request: web.Request) -> web.Response:
        try:
            principal(self.adm, request)
        except AuthError as exc:
            self.adm.reject("unauthorized", API)
            return error_response("unauthorized", str(exc))
        name = request.match_info["model"]
        for m in self._served():
            if m["id"] == name:
                return json_response(200, m)
        return error_response("model_not_found", f"the model {name!r} does not exist or has no live worker", "model")

    def _served(self) -> list[dict[str, Any]]:
        """Each base model of this edge while at least one worker for it sent a fresh heartbeat,
        each followed by its adapters with their ``parent`` (vLLM's shape, docs/lora.md)."""
        out: list[dict[str, Any]] = []
        now = time.monotonic()
        for base in self.adm.models.bases:
            live = self.adm.models.live(base, now)
            if not live:
                continue
            created = int(min(s.ts for s in live))

            # OpenAI's model object, with Anthropic's fields (type, display_name, created_at) besides
            def entry(name: str, created: int = created, **extra: str) -> dict:
                return {"id": name, "object": "model", "created": created, "owned_by": "lockgate", "type": "model",
                        "display_name": name, "created_at": datetime.fromtimestamp(created, UTC).isoformat(), **extra}
            out += [entry(base)] + [entry(name, parent=base) for name in self.adm.adapters(base)]
        return out

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        call = await authed_json(self.adm, request)
        if isinstance(call, web.Response):
            return call
        return await self.answer(call.body, call.who, chat, request)

    async def answer(self, body: Any, who: Principal, chat: bool,
                     request: web.Request | None = None) -> web.StreamResponse:
        """One chat or completions request from its decoded body: what ``POST`` answers. Without
        ``request`` (a batch line, :mod:`edge.openai.batches`) nothing is streamed (the caller
        refuses ``stream``) and there is no client connection or trace header."""
        adm = self.adm
        try:
            model = body.get("model") if isinstance(body, dict) else None
            # a base model of this edge or an adapter of one (docs/lora.md); its tokenizer on first use
            encoder = await adm.encoder_for(model if isinstance(model, str) and model else adm.config.model)
            req = (parse_chat if chat else parse_completion)(body, encoder.context_len)
            keep = resumable(body, req)  # a resumable chat stream (edge.openai.resume)
            if req.tools is not None:  # tools and tool turns: the prompt (and forcing grammar) of edge.chat.tools
                g = await asyncio.to_thread(prepare, req.generate, req.tools, encoder, configured_parser(adm.config.tool_call_parser, adm.config.model, adm.config.model_path))
                req = replace(req, generate=g)
        except ProtocolError as exc:
            return refusal(adm, exc)
        return await self._answer(request, req, who, body, encoder, keep)

    async def _answer(self, request: web.Request | None, req: OpenAIRequest, who: Principal,
                      body: dict[str, Any], encoder: PromptEncoder, keep: bool = False) -> web.StreamResponse:
        """Every chat and completions request, ``n`` = 1 included (one choice of one prompt): one
        request on the bus per choice of each prompt, with seeds ``seed``, ``seed + 1``, ... per
        prompt (the client's seed, or one drawn), so the choices differ and each is reproducible
        and resumable on its own; choice ``i`` of prompt ``p`` is index ``p * n + i``; their sinks
        share one wake-up; one answer (or one event stream) holds them all. A choice refused at
        admission refunds the others; one failing fails the whole answer (leaving the ``with``
        block cancels the rest, as it does when the client goes away). ``keep``: a resumable
        stream (one choice): owned by the admission's ``resumables`` (it runs on when its client
        goes), recorded in the fleet's table, its events numbered."""
        adm = self.adm
        base = req.generate.sampling.seeded().seed
        assert base is not None
        wake = asyncio.Event()
        transport = request.transport if request is not None else None
        sinks: list[OpenAIStream] = []
        # every choice's span joins the client's trace
        parent = adm.trace_parent(request.headers) if request is not None else None
        admitted: list[Admitted] = []
        with adm.streams() as owned:
            for p, i in ((p, i) for p in range(len(req.batch)) for i in range(req.n)):
                one = req.batch[p]
                g = replace(one, sampling=replace(one.sampling, seed=(base + i) % (1 << 63)))
                sink = OpenAIStream(adm.config, req, encoder, adm.config.send_queue_frames,
                                    on_overflow=lambda: transport.abort() if transport is not None else None,
                                    wake=wake, index=p * req.n + i, echo=_echo(req, one, encoder))
                sink.numbered = keep
                try:
                    a = await adm.admit(g, who, sink, API, adm.resumables if keep else owned, client_id="",
                                        trace_parent=parent)
                except ProtocolError as exc:
                    field = openai_param(exc.field, body, "response_format", "response_format")
                    if field == "prompt" and len(req.batch) > 1:  # which prompt of the batch
                        field = f"prompt[{p}]"
                    return refusal(adm, exc, field)
                assert a is not None
                sink.bind(a.stream, base)
                sinks.append(sink)
                admitted.append(a)
            if req.stream:
                assert request is not None, "a batch line never streams"
                return await self._stream(request, sinks, admitted, wake, who, body if keep else None)
            for a in admitted:
                await adm.publish(a)
            while not all(s.closed for s in sinks):
                await wake.wait()
                wake.clear()
            failed = next((s.error for s in sinks if s.error is not None), None)
            if failed is not None:
                return failed_response(failed)
            return json_response(200, merged_response(sinks))

    async def _stream(self, request: web.Request, sinks: list[OpenAIStream], admitted: list[Admitted],
                      wake: asyncio.Event, who: Principal, resumable_body: dict[str, Any] | None) -> web.StreamResponse:
        # written to the bus before the 200 goes out: a request the bus did not take is a plain
        # error status (503 with the bus down), never a 200 stream that ends in an error event
        headers = SSE_HEADERS
        for a in admitted:
            if resumable_body is not None:  # its record (where any edge finds it) along with the publish
                put = asyncio.ensure_future(record(self.adm, who, a, sinks[0], resumable_body))
                try:
                    ok = await self.adm.publish(a)
                finally:
                    await put
                headers = {**SSE_HEADERS, RESUME_HEADER: sinks[0].id}
            else:
                ok = await self.adm.publish(a)
            if not ok:
                return failed_response(next(s.error for s in sinks if s.error is not None))
        try:
            return await self._write_stream(request, sinks, wake, headers)
        finally:
            for s in sinks:  # a resumable stream runs on without its client: nothing more is kept
                s.detached = s.numbered

    async def _write_stream(self, request: web.Request, sinks: list[OpenAIStream], wake: asyncio.Event,
                            headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        req = sinks[0].req
        try:
            # Nothing goes out before the first output (a token, the end or an error): TTFT as
            # clients and benchmark tools read it is the first streamed chunk's arrival, so the
            # content-free role chunk (and completions' echo) leaves in the same write as the
            # first token, as vLLM sends it (docs/protocol.md, "Streaming").
            while not any(s.started for s in sinks):
                await wake.wait()
                wake.clear()
            head = b"".join(s.role_event() for s in sinks) if req.chat else b""
            while True:
                data = head + b"".join(s.take() for s in sinks)
                head = b""
                if data:
                    await resp.write(data)
                failed = any(s.error is not None for s in sinks)
                if failed or all(s.closed for s in sinks):
                    break
                await wake.wait()
                wake.clear()
            if not failed and req.include_usage:
                await resp.write(sinks[0].event(sse(sinks[0].head(choices=[], usage=merged_usage(sinks)))))
            await resp.write(sinks[0].event(DONE))
            await resp.write_eof()
        except ConnectionError:  # the client went away (or was cut off as too slow): the caller cancels
            pass
        return resp
