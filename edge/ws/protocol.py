"""The WebSocket client protocol: typed frames, strict parsing, server-frame encoding.

Every frame is one JSON object with a ``type``. See ``docs/protocol.md`` for the full description.
:func:`parse_client_frame` never raises anything but :class:`ProtocolError`, whose ``field`` names
the offending field (``None`` when the frame as a whole is bad), so the session answers with an
``error`` frame and the connection stays usable. Pure apart from the tokenizer (CPU only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from bus import ChatMessage, SamplingParams
from edge.fields import type_name
from edge.guided import GUIDED_FIELDS, FieldError, guided_fields, logit_bias
from edge.request import MAX_CACHE_SALT, MAX_ID_LEN, MAX_MESSAGES, Generate, ProtocolError, requested_tier

ROLES = ("system", "user", "assistant", "tool")
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "logprobs", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "min_tokens")
# logit_bias, response_format and the guided_* fields are converted by edge.guided (as for OpenAI)
_GENERATE_FIELDS = frozenset(("type", "id", "model", "messages", "prompt", "token_ids", "logit_bias", "response_format",
                              "cache_salt", "resumable", "priority", "service_tier")
                             + _SAMPLING_FIELDS + GUIDED_FIELDS)
_CANCEL_FIELDS = frozenset(("type", "id", "request_id"))
_RESUME_FIELDS = frozenset(("type", "id", "request_id", "seq"))


@dataclass(frozen=True, slots=True)
class CancelFrame:
    id: str | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class ResumeFrame:
    """Pick up a resumable request again (on any edge): its deltas from output index ``seq`` on (the
    index the client expects next: the last delta's ``seq`` plus its ``token_ids`` count), then live,
    under the client id ``id`` on this connection."""

    id: str
    request_id: str
    seq: int


ClientFrame = Generate | CancelFrame | ResumeFrame


def _str(obj: dict, name: str, fid: str | None, *, required: bool = False, max_len: int | None = None) -> str | None:
    v = obj.get(name)
    if v is None:
        if required:
            raise ProtocolError(f"{name} is required", name, fid)
        return None
    if not isinstance(v, str):
        raise ProtocolError(f"{name} must be a string, got {type_name(v)}", name, fid)
    if required and not v:
        raise ProtocolError(f"{name} must not be empty", name, fid)
    if max_len is not None and len(v) > max_len:
        raise ProtocolError(f"{name} is longer than {max_len} characters", name, fid)
    return v


def parse_client_frame(data: str | bytes, default_max_tokens: int = 256) -> ClientFrame:
    """Parse and validate one client frame. Raises :class:`ProtocolError` only."""
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must be a JSON object, got {type_name(obj)}")
    fid = obj.get("id") if isinstance(obj.get("id"), str) and len(obj["id"]) <= MAX_ID_LEN else None
    kind = obj.get("type")
    if kind == "generate":
        return _parse_generate(obj, fid, default_max_tokens)
    if kind == "cancel":
        unknown = set(obj) - _CANCEL_FIELDS
        if unknown:
            raise ProtocolError(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0], fid)
        cid = _str(obj, "id", fid, max_len=MAX_ID_LEN)
        rid = _str(obj, "request_id", fid, max_len=MAX_ID_LEN)
        if not cid and not rid:
            raise ProtocolError("cancel needs id or request_id", "id", fid)
        return CancelFrame(cid or None, rid or None)
    if kind == "resume":
        unknown = set(obj) - _RESUME_FIELDS
        if unknown:
            raise ProtocolError(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0], fid)
        cid = _str(obj, "id", fid, required=True, max_len=MAX_ID_LEN)
        rid = _str(obj, "request_id", fid, required=True, max_len=MAX_ID_LEN)
        seq = obj.get("seq", 0)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ProtocolError("seq must be an integer >= 0 (the output index expected next)", "seq", fid)
        assert cid is not None and rid is not None  # required: _str raised otherwise
        return ResumeFrame(cid, rid, seq)
    if kind is None:
        raise ProtocolError("type is required ('generate', 'cancel' or 'resume')", "type", fid)
    raise ProtocolError(f"unknown type {str(kind)[:40]!r}: expected 'generate', 'cancel' or 'resume'", "type", fid)


def _parse_generate(obj: dict, fid: str | None, default_max_tokens: int) -> Generate:
    unknown = set(obj) - _GENERATE_FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise ProtocolError(f"unknown field {name[:40]!r}", name[:40], fid)
    cid = _str(obj, "id", fid, required=True, max_len=MAX_ID_LEN)
    assert cid is not None  # required: _str raised otherwise
    model = _str(obj, "model", cid)
    prompt = _str(obj, "prompt", cid)
    messages = None
    raw = obj.get("messages")
    if raw is not None:
        if not isinstance(raw, list) or not raw:
            raise ProtocolError("messages must be a non-empty array of {role, content}", "messages", cid)
        if len(raw) > MAX_MESSAGES:
            raise ProtocolError(f"messages has {len(raw)} entries, at most {MAX_MESSAGES}", "messages", cid)
        out = []
        for i, m in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or set(m) - {"role", "content"}:
                raise ProtocolError(f"{where} must be an object with only role and content", where, cid)
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise ProtocolError(f"{where}.role must be one of {list(ROLES)}", f"{where}.role", cid)
            if not isinstance(content, str):
                raise ProtocolError(f"{where}.content must be a string, got {type_name(content)}", f"{where}.content", cid)
            out.append(ChatMessage(role, content))
        messages = tuple(out)
    if (messages is None) == (prompt is None):
        raise ProtocolError("give exactly one of messages or prompt", "messages", cid)
    if prompt is not None and not prompt:
        raise ProtocolError("prompt must not be empty", "prompt", cid)
    token_ids = obj.get("token_ids", False)
    if not isinstance(token_ids, bool):
        raise ProtocolError("token_ids must be a boolean", "token_ids", cid)
    resumable = obj.get("resumable", False)
    if not isinstance(resumable, bool):
        raise ProtocolError("resumable must be a boolean", "resumable", cid)
    kwargs = {k: obj[k] for k in _SAMPLING_FIELDS if k in obj and obj[k] is not None}
    kwargs.setdefault("max_tokens", default_max_tokens)
    for k in ("stop", "stop_token_ids"):
        if k in kwargs and not isinstance(kwargs[k], list):
            raise ProtocolError(f"{k} must be an array, got {type_name(kwargs[k])}", k, cid)
    for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = kwargs.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            raise ProtocolError(f"{k} must be finite", k, cid)
    try:
        kwargs.update(guided_fields(obj))
        bias = logit_bias(obj.get("logit_bias"))
    except FieldError as exc:
        raise ProtocolError(exc.message, exc.field, cid) from None
    if bias is not None:
        kwargs["logit_bias"] = bias
    try:
        sampling = SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        field = next((k for k in sorted(kwargs, key=len, reverse=True) if msg.startswith(k)), None)
        raise ProtocolError(msg[:300], field, cid) from None
    salt = _str(obj, "cache_salt", cid, max_len=MAX_CACHE_SALT)
    # a resumable request's deltas always carry token_ids: its client counts the index to resume from
    return Generate(cid, sampling, messages, prompt, model, "max_tokens" in obj, token_ids or resumable,
                    cache_salt=salt, resumable=resumable, tier=requested_tier(obj, cid))


# --- server frames ------------------------------------------------------------------------------

def _dumps(obj: dict) -> bytes:
    return orjson.dumps(obj)


def accepted_frame(id: str, request_id: str, prompt_tokens: int, max_tokens: int, seed: int | None) -> bytes:
    return _dumps({"type": "accepted", "id": id, "request_id": request_id,
                   "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "seed": seed})


def delta_frame(id: str, seq: int, text: str, token_ids: Sequence[int] | None = None,
                logprobs: Any = None) -> bytes:
    obj: dict[str, Any] = {"type": "delta", "id": id, "seq": seq, "text": text}
    if token_ids is not None:
        obj["token_ids"] = token_ids
    if logprobs is not None:
        obj["logprobs"] = logprobs
    return _dumps(obj)


def done_frame(id: str, request_id: str, finish_reason: str, usage: dict, timings: dict) -> bytes:
    return _dumps({"type": "done", "id": id, "request_id": request_id, "finish_reason": finish_reason,
                   "usage": usage, "timings": timings})


def error_frame(code: str, message: str, *, id: str | None = None, request_id: str | None = None,
                field: str | None = None, retry_after: float | None = None) -> bytes:
    obj: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if id is not None:
        obj["id"] = id
    if request_id is not None:
        obj["request_id"] = request_id
    if field is not None:
        obj["field"] = field
    if retry_after is not None:
        obj["retry_after"] = retry_after
    return _dumps(obj)


def refusal_frame(exc: ProtocolError) -> bytes:
    """The ``error`` frame that answers a refused request."""
    return error_frame(exc.code, exc.message, id=exc.id, field=exc.field, retry_after=exc.retry_after)
