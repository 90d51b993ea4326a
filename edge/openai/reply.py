"""The HTTP plumbing every OpenAI-API route shares: JSON replies, OpenAI-shaped errors (refusals
and failed streams), the bearer key, the JSON body. Every route (chat and completions, tokenize,
embeddings, responses, the probes) uses these, so their errors look exactly alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from edge.admission.auth import AuthError, Principal
from edge.admission.gate import Admission
from edge.http import json_response
from edge.openai.schema import ErrorReply, error_body
from edge.request import ProtocolError

API = "openai"


def error_response(code: str, message: str, param: str | None = None,
                   retry_after: float | None = None) -> web.Response:
    status, body = error_body(code, message, param)
    resp = json_response(status, body, retry_after)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="lockgate"'
    return resp


def failed_response(e: ErrorReply) -> web.Response:
    """A request whose stream failed (:func:`~edge.openai.schema.error_reply`), as its HTTP answer."""
    return json_response(e.status, e.body, e.retry_after)


def refusal(adm: Admission, exc: ProtocolError, param: str | None = None) -> web.Response:
    """A request refused before or at admission: counted (``edge_rejections``, ``api="openai"``)
    and answered in OpenAI's words; ``param``: the field to name, when not ``exc.field`` as is."""
    adm.reject(exc.code, API)
    return error_response(exc.code, exc.message, exc.field if param is None else param, exc.retry_after)


def principal(adm: Admission, request: web.Request) -> Principal:
    """The caller's key (``Authorization: Bearer``); raises :class:`~edge.auth.AuthError`."""
    scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
    key = value.strip() if scheme.lower() == "bearer" and value.strip() else None
    return adm.auth.authenticate(key)


def caller(adm: Admission, request: web.Request) -> Principal | web.Response:
    """The caller's key, or the 401 to send (counted as a refusal): every route's first step."""
    try:
        return principal(adm, request)
    except AuthError as exc:
        adm.reject("unauthorized", API)
        return error_response("unauthorized", str(exc))


async def read_json(adm: Admission, request: web.Request) -> Any:
    """The decoded body; :class:`ProtocolError` when it is not JSON or too large."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"the request body is larger than {adm.config.max_frame_bytes} bytes") from None


@dataclass(frozen=True, slots=True)
class Call:
    """An authenticated request: its caller's key and its decoded JSON body (not yet validated)."""

    who: Principal
    body: Any


async def authed_json(adm: Admission, request: web.Request) -> Call | web.Response:
    """The caller and the decoded body, or the 401 / 400 to send: every JSON route's first step."""
    who = caller(adm, request)
    if isinstance(who, web.Response):
        return who
    try:
        return Call(who, await read_json(adm, request))
    except ProtocolError as exc:
        return refusal(adm, exc)


def check_model(adm: Admission, body: dict[str, Any], required: bool = True) -> None:
    """``model`` must name the served model (404 ``model_not_found`` otherwise); optional where
    vLLM makes it optional (tokenize)."""
    model = body.get("model")
    if model is None and not required:
        return
    if not isinstance(model, str) or not model:
        raise ProtocolError("model is required (a non-empty string)", "model")
    if not adm.serves(model):  # a base model of this edge or an adapter of one: docs/lora.md
        raise ProtocolError(f"the model {model[:200]!r} does not exist; this server serves {adm.config.model!r}",
                            "model", code="model_not_found")
