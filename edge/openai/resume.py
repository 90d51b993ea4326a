"""Resumable chat-completion streams: ``"resumable": true`` on ``POST /v1/chat/completions`` and
``GET /v1/chat/completions/{id}`` on any edge (docs/protocol.md, "Resuming a stream").

A resumable stream (``stream: true``, one choice) is owned by the admission's ``resumables`` (not
cancelled when its client goes), numbers its SSE events (``id: <n>``, :class:`OpenAIStream`) and is
recorded in the fleet's table (:class:`~edge.admission.resumable.StreamDirectory`, as a resumable
WebSocket request) with what another edge needs to send the same bytes: the request's body, its
``created`` time and seed. A resume rebuilds the choice's sink from that record and feeds it the
request's replies read back from the reply topic (:mod:`edge.admission.replay`, the one replay
path): the same records through the same sink give the same events; those at or below the
client's position (``Last-Event-ID`` or ``?starting_after=N``) are dropped, the rest are written,
then live ones until ``[DONE]``. Another key's id is a 404, as an unknown one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from bus import BusError
from edge.admission.auth import Principal
from edge.admission.gate import Admission, Admitted
from edge.admission.lifecycle import Stream
from edge.admission.replay import Replay, ReplyOrigin, detached_stream
from edge.admission.resumable import ResumableStream
from edge.http import SSE_HEADERS
from edge.openai.reply import caller, error_response, refusal
from edge.openai.schema import OpenAIRequest, parse_chat
from edge.openai.stream import DONE, OpenAIStream, merged_usage, sse
from edge.request import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

RESUME_HEADER = "X-Lockgate-Resumable-Id"  # the id to resume a stream by (its chunks' ``id``)
ID_PREFIX = "chatcmpl-"
# A replay's sink holds at most one read batch of events: the handler writes them after each read.
REPLAY_PENDING = 1 << 30


def resumable(body: Any, req: OpenAIRequest) -> bool:
    """The ``resumable`` extension field of a chat or completions body (default false). Raises
    :class:`ProtocolError` naming it unless it is a boolean, and when true for anything but a
    streamed chat completion with one choice."""
    v = body.get("resumable") if isinstance(body, dict) else None
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ProtocolError(f"resumable must be a boolean, got {type(v).__name__}", "resumable")
    if v and not (req.chat and req.stream and req.n == 1):
        raise ProtocolError("resumable needs a streamed chat completion (stream: true) with n = 1", "resumable")
    return v


async def record(adm: Admission, who: Principal, a: Admitted, sink: OpenAIStream, body: dict[str, Any]) -> None:
    """Write ``a``'s record to the fleet's table; a failure is logged (the stream runs, but cannot
    be resumed on another edge)."""
    directory = adm.directory
    if directory is None:
        return
    req, s = a.request, a.stream
    rec = ResumableStream(who.entry.key_hash, ReplyOrigin(req.request_id, req.reply_to, int(req.enqueued_at * 1000)),
                          s.prompt_tokens, s.max_tokens, sink.created, sink.seed, orjson.dumps(body).decode())
    try:
        async with asyncio.timeout(adm.config.publish_timeout_s):
            await directory.put(rec)
    except (BusError, TimeoutError) as exc:
        log.warning("recording resumable request %s failed: %s", req.request_id, exc)


def _position(request: web.Request) -> int:
    """The last event id the client has: ``Last-Event-ID`` (SSE's reconnect header) or
    ``starting_after``; -1 (everything) when neither is given."""
    raw = request.headers.get("Last-Event-ID")
    field = "Last-Event-ID"
    if raw is None:
        raw, field = request.query.get("starting_after"), "starting_after"
    if raw is None or raw.strip() == "":
        return -1
    try:
        n = int(raw)
    except ValueError:
        raise ProtocolError(f"{field} must be an integer event id, got {raw!r}", field) from None
    if n < -1:
        raise ProtocolError(f"{field} must be -1 or more, got {n}", field)
    return n


class ChatResumeRoutes:
    def __init__(self, adm: Admission) -> None:
        self.adm = adm

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/chat/completions/{id}", self.resume)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        adm = self.adm
        who = caller(adm, request)
        if isinstance(who, web.Response):
            return who
        cid = request.match_info["id"]
        try:
            after = _position(request)
        except ProtocolError as exc:
            return refusal(adm, exc)
        rec = None
        if cid.startswith(ID_PREFIX) and adm.directory is not None:
            try:
                rec = await adm.directory.get(who.entry.key_hash, cid[len(ID_PREFIX):])
            except BusError as exc:
                return error_response(ErrorCode.OVERLOADED, f"the stream directory is unreachable: {exc}", None, 1.0)
        if rec is None or not rec.body:  # unknown, expired, another key's, or a WebSocket request
            return error_response("not_found", f"no resumable chat completion {cid!r}", "id")
        try:
            body = orjson.loads(rec.body)
            encoder = await adm.encoder_for(body.get("model") or adm.config.model)
            req = parse_chat(body, encoder.context_len)
        except (ProtocolError, orjson.JSONDecodeError, AttributeError) as exc:
            log.warning("the record of %s cannot be read back: %s", cid, exc)
            return error_response("not_found", f"no resumable chat completion {cid!r}", "id")
        wake = asyncio.Event()
        sink = OpenAIStream(adm.config, req, encoder, REPLAY_PENDING, on_overflow=lambda: None, wake=wake)
        sink.numbered, sink.skip_through, sink.created = True, after, rec.created
        s = detached_stream(rec.origin.request_id, sink, rec.prompt_tokens, rec.max_tokens)
        sink.bind(s, rec.seed)
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, RESUME_HEADER: sink.id})
        await resp.prepare(request)
        try:
            await self._replay(resp, sink, s, rec.origin)
        except ConnectionError:  # the client went away: reading a stream never stops it
            pass
        return resp

    async def _replay(self, resp: web.StreamResponse, sink: OpenAIStream, s: Stream, origin: ReplyOrigin) -> None:
        """The live path's writes (edge.openai.routes), from the replayed sink."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.adm.config.request_timeout_s
        head = True
        try:
            async with Replay(self.adm.bus, origin, s) as r:
                more = True
                while more:
                    more = await r.advance(live=True)
                    if head and sink.started:
                        data, head = sink.role_event() + sink.take(), False
                    else:
                        data = sink.take()
                    if data:
                        await resp.write(data)
                    if more and loop.time() > deadline:
                        await resp.write(sse(error_body("no end of the request before the deadline")))
                        return
        except BusError as exc:
            await resp.write(sse(error_body(f"the reply topic could not be read: {exc}")))
            return
        if sink.error is None and sink.req.include_usage:
            await resp.write(sink.event(sse(sink.head(choices=[], usage=merged_usage([sink])))))
        await resp.write(sink.event(DONE))
        await resp.write_eof()


def error_body(message: str) -> dict[str, Any]:
    """An error event of a resume that could not follow the stream to its end (not numbered: it is
    not one of the stream's events)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}
