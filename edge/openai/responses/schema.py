"""``POST /v1/responses`` bodies -> the chat request they mean (pure; no I/O).

A Responses request is a chat request spelled differently, so it is translated into a chat body and
parsed by :func:`edge.openai.schema.parse_chat`: the same sampling fields, structured output, tools
and prompt building, the same admission after. The translation:

* ``instructions`` -> a leading system message (not carried into a follow-up turn, as OpenAI);
* ``input`` a string -> one user message; an array of items: messages (``role`` user, system,
  developer, assistant; ``content`` a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (consecutive ones become one assistant turn with ``tool_calls``) and
  ``function_call_output`` items (``tool`` turns); other item types are refused naming the item;
* ``max_output_tokens`` -> ``max_tokens``; ``tools`` (flat function tools) and ``tool_choice``
  (``{"type": "function", "name"}``) -> chat's nested spelling; ``text.format`` -> ``response_format``;
* ``previous_response_id``: the stored conversation (:mod:`edge.openai.responses.store`) goes first.

Errors are :class:`~edge.request.ProtocolError` naming the Responses field (``input[2].call_id``,
``max_output_tokens``, ``text.format``), never the chat field it was translated into.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from edge.fields import type_name
from edge.openai.responses.items import check_include, input_items
from edge.openai.schema import OpenAIRequest, parse_chat
from edge.request import MAX_MESSAGES, ProtocolError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
UNSUPPORTED = ("conversation", "prompt")  # refused when set: no silent change of meaning


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """One parsed request. ``chat``: the chat request it runs as; ``history``: its chat messages
    without the instructions (what a follow-up turn's ``previous_response_id`` continues);
    ``echo``: the request fields the response object repeats (OpenAI's shape)."""

    chat: OpenAIRequest
    history: tuple[dict[str, Any], ...]
    stream: bool
    store: bool
    parallel_tool_calls: bool
    previous_response_id: str | None
    echo: dict[str, Any]
    input_items: tuple[dict[str, Any], ...] = ()  # this request's input as GET .../input_items lists it
    # runs on without its client (create answers at once); readable, resumable and cancellable from
    # any edge (docs/protocol.md, "Resuming a stream")
    background: bool = False


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where} must be a string or an array of input_text parts, got {type_name(content)}", where)
    out = []
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type_name(p)
            raise ProtocolError(f"{where}[{i}] must be an input_text part {{\"type\": \"input_text\", \"text\": ...}}; "
                                f"{str(kind)[:40]!r} is not supported", f"{where}[{i}]")
        out.append(p["text"])
    return "".join(out)


def input_messages(raw: object) -> tuple[list[dict[str, Any]], list[str]]:
    """``input`` as chat messages, and for each message the ``input[...]`` it came from."""
    if isinstance(raw, str):
        if not raw:
            raise ProtocolError("input must not be empty", "input")
        return [{"role": "user", "content": raw}], ["input"]
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("input must be a non-empty string or a non-empty array of items", "input")
    if len(raw) > MAX_MESSAGES:
        raise ProtocolError(f"input has {len(raw)} items, at most {MAX_MESSAGES}", "input")
    msgs: list[dict[str, Any]] = []
    origin: list[str] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{where} must be an object, got {type_name(item)}", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ProtocolError(f"{where}.role must be one of {list(ROLES)}", f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            origin.append(where)
        elif kind == "function_call":
            for f in ("call_id", "name", "arguments"):
                if not isinstance(item.get(f), str) or (f != "arguments" and not item[f]):
                    raise ProtocolError(f"{where}.{f} must be a string", f"{where}.{f}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            prev = msgs[-1] if msgs else None
            if prev is not None and prev["role"] == "assistant" and prev.get("tool_calls") and not prev["content"]:
                prev["tool_calls"].append(call)  # parallel calls of one turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origin.append(where)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise ProtocolError(f"{where}.call_id must be a string", f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"{where}.output")})
            origin.append(where)
        elif kind == "reasoning":
            continue  # a reasoning item handed back: the prompt does not show reasoning (as chat drops it)
        else:
            raise ProtocolError(f"{where}.type {str(kind)[:40]!r} is not supported: use message, function_call, "
                                "function_call_output", f"{where}.type")
    return msgs, origin


def _tools(obj: dict[str, Any]) -> tuple[Any, Any]:
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ProtocolError("tools must be an array of function tools", "tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type_name(t)
                raise ProtocolError(f"tools[{i}]: only function tools are supported, got {str(kind)[:40]!r}",
                                    f"tools[{i}]")
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                         if t.get(k) is not None}})
        tools = out
    choice = obj.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError('tool_choice must be "auto", "none", "required" or {"type": "function", "name"}',
                                "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _format(obj: dict[str, Any]) -> Any:
    text = obj.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ProtocolError("text must be an object {format}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ProtocolError("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt  # text, json_object: the same spelling as chat's response_format


_FIELD = re.compile(r"^messages\[(\d+)\]")
_RENAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format", "messages": "input"}


def _field(field: str | None, origin: list[str]) -> str | None:
    """A chat field named in a parse error -> the Responses field it came from."""
    if field is None:
        return None
    m = _FIELD.match(field)
    if m is not None:
        i = int(m.group(1))
        return (origin[i] if i < len(origin) else "input") + field[m.end():]
    if field.startswith("response_format"):
        return "text.format" + field[len("response_format"):]
    if field.startswith("tools[") and ".function." in field:
        return field.replace(".function.", ".", 1)
    return _RENAMES.get(field, field)


def parse_responses(obj: Any, default_max_tokens: int, previous: tuple[dict[str, Any], ...] = ()) -> ResponsesRequest:
    """``POST /v1/responses``; ``previous``: the stored history of ``previous_response_id`` (the
    caller looks it up first). Raises :class:`ProtocolError` only."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type_name(obj)}")
    for name in UNSUPPORTED:
        if obj.get(name) not in (None, False):
            raise ProtocolError(f"{name} is not supported by this server", name)
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ProtocolError("instructions must be a string", "instructions")
    msgs, origin = input_messages(obj.get("input"))
    check_include(obj.get("include"))
    history = [dict(m) for m in previous] + msgs
    origin = ["previous_response_id"] * len(previous) + origin
    head = [{"role": "system", "content": instructions}] if instructions else []
    tools, choice = _tools(obj)
    store, parallel = obj.get("store", True), obj.get("parallel_tool_calls", True)
    background = obj.get("background", False)
    for name, v in (("store", store), ("parallel_tool_calls", parallel), ("stream", obj.get("stream", False)),
                    ("background", background)):
        if v is not None and not isinstance(v, bool):
            raise ProtocolError(f"{name} must be a boolean", name)
    chat_body: dict[str, Any] = {
        "model": obj.get("model"), "messages": head + history,
        "max_tokens": obj.get("max_output_tokens"), "temperature": obj.get("temperature"), "top_p": obj.get("top_p"),
        "tools": tools, "tool_choice": choice, "response_format": _format(obj), "user": obj.get("user"),
        "seed": obj.get("seed"),
    }
    for extra in ("top_k", "min_p", "repetition_penalty", "stop", "ignore_eos", "cache_salt"):  # vLLM's extras
        if extra in obj:
            chat_body[extra] = obj[extra]
    try:
        chat = parse_chat({k: v for k, v in chat_body.items() if v is not None}, default_max_tokens)
    except ProtocolError as exc:
        raise ProtocolError(exc.message, _field(exc.field, (["instructions"] if head else []) + origin), code=exc.code) from None
    if background and store is False:
        raise ProtocolError("background responses must be stored: background true needs store true (the default)",
                            "background")
    prev = obj.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise ProtocolError("previous_response_id must be a string", "previous_response_id")
    echo = {"instructions": instructions, "max_output_tokens": obj.get("max_output_tokens"),
            "temperature": obj.get("temperature"), "top_p": obj.get("top_p"),
            "tools": obj.get("tools") or [], "tool_choice": obj.get("tool_choice") or "auto",
            "text": obj.get("text") or {"format": {"type": "text"}}, "metadata": obj.get("metadata"),
            "user": obj.get("user"), "parallel_tool_calls": parallel is not False, "store": store is not False,
            "previous_response_id": prev, "truncation": "disabled", "reasoning": None}
    return ResponsesRequest(replace(chat, stream=False), tuple(history), bool(obj.get("stream")),
                            store is not False, parallel is not False, prev, echo, input_items(obj["input"]),
                            background=bool(background))
