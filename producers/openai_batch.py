"""The OpenAI Batch API line formats. Pure: no asyncio, no bus, no tokenizer.

Input (one JSON object per line)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}

``url`` is ``/v1/chat/completions`` (``messages``) or ``/v1/completions`` (``prompt``: a string, a
list of one string, or a list of token ids). ``body.model`` is ignored: the job's ``--model``
serves every line. Supported sampling fields: ``max_tokens`` (``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``; ``n`` must be 1;
``stream`` must be false; a few harmless fields are accepted and ignored (``user``,
``metadata``, zero penalties, ...). Anything else is an invalid line.

Output (one line per input line)::

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {<chat.completion>}}, "error": null}

A line that cannot be run (bad JSON, unknown url, invalid params, missing or duplicate custom_id)
becomes ``{"id": ..., "custom_id": <id or null>, "response": null, "error": {"code":
"invalid_request", "message": "line N: ...", "line": N}}``. ``custom_id`` is null when the line has
none or repeats an earlier one (so custom_ids in the output stay unique); ``error.line`` then
identifies the record on resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bus import ChatMessage, SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_MAX_TOKENS = 256
MAX_CUSTOM_ID = 512

_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "n", "stream", "presence_penalty",
            "frequency_penalty", "logit_bias", "stream_options", "echo", "best_of", "suffix"}
_ZERO_OK = {"presence_penalty", "frequency_penalty"}
_NULL_OK = {"logit_bias", "stream_options", "suffix", "user", "metadata", "store", "service_tier", "model"}


class LineError(ValueError):
    """A line that cannot be run; the message is for the error record."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One runnable input line."""

    line: int  # 1-based
    custom_id: str
    url: str
    sampling: SamplingParams
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that becomes an error record. ``custom_id`` is None when missing or duplicated."""

    line: int
    custom_id: str | None
    message: str


def parse_line(text: str, line: int, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> BatchRequest | BadLine:
    """Parse one input line (without its newline). Never raises."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return BadLine(line, None, f"line {line}: not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return BadLine(line, None, f"line {line}: expected a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return BadLine(line, None, f"line {line}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    try:
        return _parse_request(obj, cid, line, default_max_tokens)
    except LineError as exc:
        return BadLine(line, cid, f"line {line}: {exc}")


def _parse_request(obj: dict, cid: str, line: int, default_max_tokens: int) -> BatchRequest:
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f"method must be POST, got {method!r}")
    url = obj.get("url")
    if url not in URLS:
        raise LineError(f"unknown url {url!r}: expected one of {', '.join(URLS)}")
    unknown_top = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown_top:
        raise LineError(f"unknown field {sorted(unknown_top)[0]!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("body must be a JSON object")
    sampling = _sampling(body, default_max_tokens)
    if url == CHAT_URL:
        extra = set(body) - _SAMPLING - _IGNORED - {"messages"}
        if extra:
            raise LineError(f"unsupported parameter {sorted(extra)[0]!r} for {url}")
        return BatchRequest(line, cid, url, sampling, messages=_messages(body.get("messages")))
    extra = set(body) - _SAMPLING - _IGNORED - {"prompt"}
    if extra:
        raise LineError(f"unsupported parameter {sorted(extra)[0]!r} for {url}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise LineError("prompt must not be empty")
        return BatchRequest(line, cid, url, sampling, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return BatchRequest(line, cid, url, sampling, prompt_token_ids=tuple(prompt))
    raise LineError("prompt must be a non-empty string, a list of one string, or a list of token ids")


def _sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    for k in _IGNORED:
        v = body.get(k)
        if k == "n" and v not in (None, 1):
            raise LineError(f"n must be 1, got {v!r}")
        if k == "stream" and v not in (None, False):
            raise LineError("stream is not supported in batch jobs")
        if k in _ZERO_OK and v not in (None, 0, 0.0):
            raise LineError(f"{k} is not supported (must be 0)")
        if k in ("logit_bias", "stream_options", "suffix", "echo", "best_of") and v not in (None, {}, False, 1, ""):
            raise LineError(f"{k} is not supported")
    kwargs: dict[str, Any] = {}
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    kwargs["max_tokens"] = default_max_tokens if mt is None else mt
    for k in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if body.get(k) is not None:
            kwargs[k] = body[k]
    stop = body.get("stop")
    if isinstance(stop, str):
        kwargs["stop"] = (stop,)
    elif isinstance(stop, list):
        kwargs["stop"] = tuple(stop)
    elif stop is not None:
        raise LineError("stop must be a string or a list of strings")
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise LineError(f"invalid parameter: {exc}") from None


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text is supported
        parts = []
        for i, p in enumerate(value):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise LineError(f"{where}[{i}]: only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise LineError(f"{where} must be a string or a list of text parts")


def _messages(raw: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, list) or not raw:
        raise LineError("messages must be a non-empty array of {role, content}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise LineError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise LineError(f"messages[{i}].role must be one of {list(ROLES)}")
        out.append(ChatMessage("system" if role == "developer" else role, _content(m.get("content"), f"messages[{i}].content")))
    return tuple(out)


# --- output ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Completion:
    """What the platform returned for one request."""

    request_id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


def result_record(req: BatchRequest, model: str, c: Completion, created: int) -> dict:
    usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
             "total_tokens": c.prompt_tokens + c.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}
    if req.url == CHAT_URL:
        body = {"id": f"chatcmpl-{c.request_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None, "finish_reason": c.finish_reason}], "usage": usage}
    else:
        body = {"id": f"cmpl-{c.request_id}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}],
                "usage": usage}
    return {"id": f"batch_req_{c.request_id}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": c.request_id, "body": body}, "error": None}


_STATUS = {"invalid_request": 400, "unauthorized": 401, "rate_limited": 429, "overloaded": 503,
           "expired": 408, "cancelled": 499, "internal": 500}


def failed_record(req: BatchRequest, request_id: str, code: str, message: str) -> dict:
    """The platform answered with an error (HTTP-like failure of one request)."""
    return {"id": f"batch_req_{request_id}", "custom_id": req.custom_id,
            "response": {"status_code": _STATUS.get(code, 500), "request_id": request_id,
                         "body": {"error": {"message": message, "type": code, "code": code}}},
            "error": None}


def bad_line_record(bad: BadLine, job_id: str) -> dict:
    return {"id": f"batch_req_{job_id}-line{bad.line}", "custom_id": bad.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": bad.message, "line": bad.line}}


def dumps_record(record: dict) -> bytes:
    """One output line (compact JSON + newline), written with a single write."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass(frozen=True, slots=True)
class DoneSet:
    """What an existing output file already holds."""

    custom_ids: frozenset[str]
    lines: frozenset[int]  # error records without a custom_id, by input line
    records: int
    valid_bytes: int  # length of the prefix made of complete, valid lines


def scan_output(data: bytes) -> DoneSet:
    """Read an output file's bytes. A last line without its newline or not valid JSON (a write cut
    short by a crash) is not counted; ``valid_bytes`` tells where to truncate before appending."""
    cids: set[str] = set()
    lines: set[int] = set()
    records = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # truncated last line
        raw = data[pos:nl]
        try:
            obj = json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            break  # a torn write; everything from here is redone
        if isinstance(obj, dict):
            records += 1
            cid = obj.get("custom_id")
            err = obj.get("error")
            if isinstance(cid, str):
                cids.add(cid)
            elif isinstance(err, dict) and isinstance(err.get("line"), int):
                lines.add(err["line"])
        pos = nl + 1
    return DoneSet(frozenset(cids), frozenset(lines), records, pos)


def plan(lines: list[str], done: DoneSet, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[list[BatchRequest | BadLine], int]:
    """Parse every input line (1-based numbering; blank lines skipped) and drop what ``done``
    already holds. Returns (work, total records the finished output will have)."""
    seen: set[str] = set()
    todo: list[BatchRequest | BadLine] = []
    total = 0
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        total += 1
        item = parse_line(text, i, default_max_tokens)
        cid = item.custom_id
        if cid is not None and cid in seen:
            item = BadLine(i, None, f"line {i}: duplicate custom_id {cid!r} (first used on an earlier line)")
        elif cid is not None:
            seen.add(cid)
        if item.custom_id is not None and item.custom_id in done.custom_ids:
            continue
        if item.custom_id is None and i in done.lines:
            continue
        todo.append(item)
    return todo, total
