"""``POST /v1/embeddings`` from the served model.

Each input is one request on the bus with ``SamplingParams(max_tokens=1, pooling=...)``: the
worker runs its prefill only and ends it with the last prompt token's final hidden state, or the
mean of every prompt token's, L2-normalised (``Finished.embedding``; docs/design.md, "Embeddings").
Which: ``--embedding-pooling`` (``EdgeConfig.embedding_pooling``, default ``last``), or the
request's extension field ``pooling``. Last-token pooling is the default because it is what a
causal decoder's states support best (the last row is the only one that has read the whole input;
embedding models built on decoders, e5-mistral and Qwen3-Embedding, pool it the same way); mean
pooling is for checkpoints trained for it, and computes every row (no prefix-cache hits).
A chat model not trained for embeddings gives vectors of limited quality; the route is for the
served model, whatever it is.

``input``: a string, an array of strings, an array of token ids, or an array of token-id arrays (at
most ``MAX_INPUTS``); ``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32,
as OpenAI); ``dimensions`` is refused (the vectors have the model's hidden size; truncating them
is not what the model was trained for); ``user`` accepted. Admission, limits, tiers and metrics are
the chat path's (:meth:`~edge.admission.gate.Admission.admit`).
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from aiohttp import web

from bus import ErrorCode, SamplingParams
from edge.admission.auth import Principal
from edge.admission.gate import Admission, Admitted
from edge.admission.lifecycle import Done, End, Failed, Stream
from edge.openai.reply import (
    API,
    authed_json,
    check_model,
    failed_response,
    json_response,
    refusal,
)
from edge.openai.schema import MAX_PROMPT_IDS, ErrorReply, error_reply
from edge.request import Generate, ProtocolError

MAX_INPUTS = 256
POOLINGS = {name: SamplingParams(max_tokens=1, pooling=name, temperature=0.0) for name in ("last", "mean")}


def parse_inputs(body: Any, default_pooling: str = "last") -> tuple[list[Generate], str]:
    """The body's inputs as Generates, and the encoding format. ``pooling`` (an extension field,
    as vLLM's pooling parameters) overrides the server's ``default_pooling``. Raises
    :class:`ProtocolError`."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    pooling = body.get("pooling", default_pooling)
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise ProtocolError(f"pooling must be 'last' or 'mean', got {pooling!r}", "pooling")
    params = POOLINGS[pooling]
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ProtocolError("encoding_format must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise ProtocolError("dimensions is not supported: the embeddings have the model's hidden size", "dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ProtocolError("user must be a string", "user")
    raw = body.get("input")

    def ids_ok(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(raw, str) or ids_ok(raw):
        items: list[Any] = [raw]
        where = ["input"]
    elif isinstance(raw, list) and raw:
        items, where = raw, [f"input[{i}]" for i in range(len(raw))]
    else:
        raise ProtocolError("input must be a non-empty string, array of strings, array of token ids or "
                            "array of token-id arrays", "input")
    if len(items) > MAX_INPUTS:
        raise ProtocolError(f"input has {len(items)} entries, at most {MAX_INPUTS}", "input")
    if any(isinstance(i, str) for i in items) and any(isinstance(i, list) for i in items):  # OpenAI's types
        raise ProtocolError("input mixes strings and token-id arrays: an array is all strings or all token-id "
                            "arrays", "input")
    out = []
    for item, w in zip(items, where, strict=True):
        if isinstance(item, str):
            if not item:
                raise ProtocolError(f"{w} must not be empty", w)
            out.append(Generate("", params, prompt=item))
        elif ids_ok(item):
            if len(item) > MAX_PROMPT_IDS:
                raise ProtocolError(f"{w} has {len(item)} token ids, at most {MAX_PROMPT_IDS}", w)
            if any(t < 0 for t in item):
                raise ProtocolError(f"{w} token ids must be non-negative", w)
            out.append(Generate("", params, prompt_token_ids=tuple(item)))
        else:
            raise ProtocolError(f"{w} must be a non-empty string or an array of token ids", w)
    return out, fmt


class EmbeddingSink:
    """One input's request: waits for its end (a ``Done`` carries the vector)."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        self.vector: tuple[float, ...] | None = None
        self.prompt_tokens = 0
        self.error: ErrorReply | None = None
        self.closed = False

    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...],  # noqa: ARG002 - the sink's signature
                 logprobs: tuple | None) -> bool:  # noqa: ARG002
        return True  # a pooling request samples nothing; a chunk would be a worker that does not know pooling

    def on_end(self, s: Stream, end: End) -> None:
        if isinstance(end, Done):
            self.prompt_tokens = s.prompt_tokens
            if end.embedding is None:
                self.error = error_reply(ErrorCode.INTERNAL, "the worker answered without an embedding "
                                         "(it predates pooling requests)")
            else:
                self.vector = end.embedding
        elif isinstance(end, Failed):
            self.error = error_reply(end.code, end.message, end.retry_after)
        self.closed = True
        self.wake.set()


def _as_input(message: str, field: str) -> str:
    """Admission's prompt message, in this route's words (an input has no output tokens)."""
    message = message.replace("(prompt must leave room for at least one output token)",
                              "(an input must be shorter than the context)")
    return field + message[len("prompt"):] if message.startswith("prompt") else message


def encode(vector: tuple[float, ...], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return list(vector)


class EmbeddingsRoutes:
    def __init__(self, adm: Admission) -> None:
        self.adm = adm

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.create)

    async def create(self, request: web.Request) -> web.Response:
        call = await authed_json(self.adm, request)
        if isinstance(call, web.Response):
            return call
        return await self.answer(call.body, call.who, request)

    async def answer(self, body: Any, who: Principal, request: web.Request | None = None) -> web.Response:
        """One embeddings request from its decoded body: what ``POST`` answers (``request`` None:
        a batch line, no trace header)."""
        adm = self.adm
        try:
            inputs, fmt = parse_inputs(body, adm.config.embedding_pooling)
            check_model(adm, body)
        except ProtocolError as exc:
            return refusal(adm, exc)
        wake = asyncio.Event()
        sinks: list[EmbeddingSink] = []
        # every input's span joins the client's trace
        parent = adm.trace_parent(request.headers) if request is not None else None
        with adm.streams() as owned:  # leaving it (the client gone, an input failed or refused) cancels the rest
            admitted: list[Admitted] = []
            for i, g in enumerate(inputs):
                sink = EmbeddingSink(wake)
                try:
                    a = await adm.admit(g, who, sink, API, owned, client_id="", trace_parent=parent)
                except ProtocolError as exc:
                    if exc.field not in ("prompt", "messages"):
                        return refusal(adm, exc)
                    field = "input" if len(inputs) == 1 else f"input[{i}]"
                    return refusal(adm, ProtocolError(_as_input(exc.message, field), field, code=exc.code,
                                                      retry_after=exc.retry_after))
                assert a is not None
                sinks.append(sink)
                admitted.append(a)
            for a in admitted:
                await adm.publish(a)
            while not all(s.closed for s in sinks):
                await wake.wait()
                wake.clear()
            failed = next((s.error for s in sinks if s.error is not None), None)
            if failed is not None:
                return failed_response(failed)
            n = sum(s.prompt_tokens for s in sinks)
            data = [{"object": "embedding", "index": i, "embedding": encode(s.vector or (), fmt)}
                    for i, s in enumerate(sinks)]
            return json_response(200, {"object": "list", "data": data, "model": body["model"],  # as asked: a base model or an adapter
                                       "usage": {"prompt_tokens": n, "total_tokens": n}})
