"""The HTTP plumbing of the Messages API: JSON replies, refusals in Anthropic's error shape
(:mod:`edge.anthropic.errors`), the key (``x-api-key``, or ``Authorization: Bearer``), the JSON body."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from edge.admission.auth import Principal
from edge.admission.gate import Admission
from edge.anthropic.errors import API, ErrorReply, error_reply
from edge.http import json_response
from edge.request import ProtocolError


def error_response(e: ErrorReply) -> web.Response:
    return json_response(e.status, e.body, e.retry_after)


def refusal(adm: Admission, exc: ProtocolError) -> web.Response:
    """A request refused before or at admission: counted (``edge_rejections``, ``api="anthropic"``)
    and answered in Anthropic's shape; the message names the field, since the shape has no
    ``param``."""
    adm.reject(exc.code, API)
    message = exc.message if exc.field is None or exc.field in exc.message else f"{exc.field}: {exc.message}"
    return error_response(error_reply(exc.code, message, exc.retry_after))


def principal(adm: Admission, request: web.Request) -> Principal:
    """The caller's key: Anthropic's ``x-api-key``, else ``Authorization: Bearer`` (what proxies and
    ``ANTHROPIC_AUTH_TOKEN`` send). Raises :class:`~edge.admission.auth.AuthError`.
    ``anthropic-version`` and ``anthropic-beta`` are accepted whatever their value: the one
    Messages API served here is the version every SDK speaks."""
    key = request.headers.get("x-api-key", "").strip() or None
    if key is None:
        scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
        key = value.strip() if scheme.lower() == "bearer" and value.strip() else None
    return adm.auth.authenticate(key)


async def read_json(adm: Admission, request: web.Request) -> Any:
    """The decoded body; :class:`ProtocolError` when it is not JSON or too large."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"the request body is larger than {adm.config.max_frame_bytes} bytes",
                            code="request_too_large") from None
