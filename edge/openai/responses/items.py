"""A response's input items (``GET /v1/responses/{id}/input_items``) and ``include`` (pure; no I/O).

The input items are the request's ``input`` as OpenAI lists them back: a string is one user
message; message items get ``input_text`` parts (``output_text`` for assistant turns); every item
gets an ``id`` (``msg_`` / ``fc_`` / ``fco_`` / ``rs_``) and ``status: completed``. They are kept with
the stored response (:mod:`edge.openai.responses.store`), so a response made with ``store: false``
has none to list (404, as OpenAI). Items inherited through ``previous_response_id`` are not listed
(OpenAI lists the request's own ``input`` only).

``include``: this server computes none of the optional extras OpenAI names there (output-text
logprobs, encrypted reasoning, tool-call sources), so any value is refused naming ``include[i]``
rather than silently answered without it; an empty list is accepted.
"""

from __future__ import annotations

import secrets
from typing import Any

from edge.request import ProtocolError

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def check_include(raw: object, field: str = "include") -> None:
    """Raises :class:`ProtocolError` for an ``include`` that is not a list of strings, or names any extra."""
    if raw is None:
        return
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise ProtocolError(f"{field} must be an array of strings", field)
    if raw:
        raise ProtocolError(f"{field}[0] {raw[0][:80]!r} is not supported: this server computes none of the "
                            "optional include extras (output-text logprobs, encrypted reasoning, tool sources)",
                            f"{field}[0]")


def item_id(prefix: str) -> str:
    """A new output or input item id (``msg_``, ``fc_``, ``fco_``, ``rs_`` …), as OpenAI shapes them."""
    return prefix + secrets.token_hex(16)


def _parts(content: object, kind: str) -> list[dict[str, Any]]:
    texts = [content] if isinstance(content, str) else (  # validated upstream: a string or a list of parts
        [p["text"] for p in content if isinstance(p, dict)] if isinstance(content, list) else [])
    extra: dict[str, Any] = {"annotations": []} if kind == "output_text" else {}
    return [{"type": kind, "text": t, **extra} for t in texts]


def input_items(raw: object) -> tuple[dict[str, Any], ...]:
    """``input`` (already validated by :func:`~edge.openai.responses.schema.input_messages`) as items."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    assert isinstance(raw, list)
    out: list[dict[str, Any]] = []
    for item in raw:
        kind = item.get("type", "message")
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            out.append({"id": item.get("id") or item_id("msg_"), "type": "message",
                        "role": item["role"], "status": "completed", "content": _parts(item["content"], part)})
        elif kind == "function_call":
            out.append({"id": item.get("id") or item_id("fc_"), "type": "function_call",
                        "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                        "status": "completed"})
        elif kind == "function_call_output":
            output = item["output"] if isinstance(item["output"], str) else "".join(
                p["text"] for p in item["output"] if isinstance(p, dict))
            out.append({"id": item.get("id") or item_id("fco_"), "type": "function_call_output",
                        "call_id": item["call_id"], "output": output, "status": "completed"})
        elif kind == "reasoning":
            out.append({"id": item.get("id") or item_id("rs_"), "type": "reasoning",
                        "summary": item.get("summary") or []})
    return tuple(out)


def page(items: tuple[dict[str, Any], ...], query: Any) -> dict[str, Any]:
    """One page of ``items`` for the query's ``limit`` (1..100, default 20), ``order`` (``desc``
    default, as OpenAI, or ``asc``) and ``after`` (an item id). Raises :class:`ProtocolError`."""
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise ProtocolError("limit must be an integer", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ProtocolError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ProtocolError("order must be 'asc' or 'desc'", "order")
    check_include(query.getall("include[]", None) or query.getall("include", None) or None)
    seq = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        at = next((i for i, it in enumerate(seq) if it["id"] == after), None)
        if at is None:
            raise ProtocolError(f"after {after[:100]!r} is not an input item of this response", "after")
        seq = seq[at + 1:]
    data = seq[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(seq) > limit}
