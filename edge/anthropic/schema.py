"""Anthropic Messages API request bodies -> :class:`~edge.request.Generate` (pure, no I/O).

:func:`parse_messages` takes the decoded body of ``POST /v1/messages`` (or, with
``count_only``, of ``/v1/messages/count_tokens``) and raises only
:class:`~edge.request.ProtocolError` whose ``field`` is the Anthropic parameter's path
(``messages[1].content[0]``, ``tool_choice``, ...). See docs/protocol.md, "Anthropic Messages API".

How the fields map:

* ``system`` (a string or text blocks) is the template's system turn; ``messages`` alternate
  ``user`` / ``assistant`` (consecutive turns of one role are merged, as Anthropic merges them),
  starting with ``user``; text blocks are joined with newlines.
* ``tool_use`` blocks (assistant) become the turn's ``tool_calls``, ``tool_result`` blocks (user)
  ``tool`` turns with their ``tool_call_id``: the same template dicts the OpenAI chat route builds,
  rendered by :func:`edge.chat.tools.prepare`. ``thinking`` / ``redacted_thinking`` blocks of past
  turns are accepted and left out of the prompt (chat templates drop past reasoning).
* ``tools`` (``name``, ``description``, ``input_schema``) are function tools; ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` are chat's ``auto`` / ``required`` / a named function /
  ``none``, grammar-enforced alike; ``disable_parallel_tool_use`` keeps the first call only.
* ``output_config.format`` (a JSON schema) is grammar-enforced, as chat's ``response_format``.
* ``max_tokens`` is required; a value past the context is clamped to what fits (Anthropic clients
  send their model's output ceiling, not this model's), unlike OpenAI's optional field.
* accepted as hints: ``cache_control`` anywhere (the prefix cache already serves a repeated prefix),
  ``metadata.user_id``, ``thinking`` (the configured reasoning parser splits the output;
  ``budget_tokens`` is checked, and ``max_tokens`` caps thinking and answer together; ``display``
  ``omitted`` sends thinking blocks without their text),
  ``service_tier``, ``output_config.effort``; the extension ``seed`` (as chat's); unknown fields are ignored, as on the OpenAI routes.
* server tools (``web_search_…``, ``code_execution_…``: they run at Anthropic) are accepted and
  not offered to the model.
* refused with a 400 naming the block or field: image, document and other non-text blocks, a final ``assistant`` turn (prefill), a ``tool_result`` that answers no ``tool_use`` of the
  turn before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bus import ChatMessage, SamplingParams
from edge.chat.tools import MAX_TOOLS, ToolRequest
from edge.fields import int_field, num_field, type_name
from edge.guided import MAX_SCHEMA_DEPTH, schema_depth
from edge.request import MAX_MESSAGES, Generate, ProtocolError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOP_SEQUENCES = 16
ROLES = ("user", "assistant")
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """One parsed Messages request. ``generate.model`` is the requested model (checked by the
    route: 404 when it is not served). ``tools``: set when tools are offered or the history holds
    tool turns (then :func:`edge.chat.tools.prepare` renders the prompt)."""

    generate: Generate
    stream: bool
    tools: ToolRequest | None
    parallel_tool_calls: bool
    thinking_shown: bool = True  # thinking.display "omitted": thinking blocks come without their text


def _block_kind(b: object, where: str) -> str:
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise ProtocolError(f"{where} must be a content block object with a type", where)
    return str(b["type"])


def _unsupported(kind: str, where: str) -> ProtocolError:
    if kind == "image":
        why = "image blocks are not supported: the served model reads text only"
    elif kind == "document":
        why = "document blocks are not supported: send the document's text as a text block"
    else:
        why = f"{kind!r} blocks are not supported (text, tool_use, tool_result and thinking are)"
    return ProtocolError(f"{where}: {why}", where)


def _text(b: dict, where: str) -> str:
    if not isinstance(b.get("text"), str):
        raise ProtocolError(f"{where}.text must be a string", f"{where}.text")
    return str(b["text"])


def _system(v: object) -> str | None:
    """``system``: a string or an array of text blocks (joined with newlines)."""
    if v is None:
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, b in enumerate(v):
            where = f"system[{i}]"
            kind = _block_kind(b, where)
            if kind != "text":
                raise _unsupported(kind, where)
            parts.append(_text(b, where))
        return "\n".join(parts)
    raise ProtocolError(f"system must be a string or an array of text blocks, got {type_name(v)}", "system")


def _tool_result_content(v: object, where: str) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, b in enumerate(v):
            w = f"{where}[{i}]"
            kind = _block_kind(b, w)
            if kind != "text":
                raise _unsupported(kind, w)
            parts.append(_text(b, w))
        return "\n".join(parts)
    raise ProtocolError(f"{where} must be a string or an array of text blocks", where)


def _turn(m: object, i: int, prev_calls: set[str]) -> tuple[str, list[dict[str, Any]], set[str]]:
    """One message: (role, its template dicts, the tool_use ids it makes). A user turn's
    ``tool_result`` blocks become ``tool`` turns, before its text."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ProtocolError(f"{where} must be an object {{role, content}}, got {type_name(m)}", where)
    role = m.get("role")
    if role not in ROLES:
        hint = " (put the system prompt in the top-level system field)" if role == "system" else ""
        raise ProtocolError(f"{where}.role must be 'user' or 'assistant'{hint}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return str(role), [{"role": role, "content": content}], set()
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or an array of content blocks, got "
                            f"{type_name(content)}", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    made: set[str] = set()
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = _block_kind(b, w)
        if kind == "text":
            texts.append(_text(b, w))
        elif kind in ("thinking", "redacted_thinking"):
            if role != "assistant":
                raise ProtocolError(f"{w}: {kind} blocks belong to assistant turns", w)
        elif kind == "tool_use":
            if role != "assistant":
                raise ProtocolError(f"{w}: tool_use blocks belong to assistant turns", w)
            name, cid, args = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not isinstance(cid, str) or not cid or not isinstance(args, dict):
                raise ProtocolError(f"{w} must be {{type: tool_use, id, name, input: object}}", w)
            calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
            made.add(cid)
        elif kind == "tool_result":
            if role != "user":
                raise ProtocolError(f"{w}: tool_result blocks belong to user turns", w)
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or tid not in prev_calls:
                raise ProtocolError(f"{w}.tool_use_id {str(tid)[:80]!r} answers no tool_use block of the "
                                    "assistant turn before it", f"{w}.tool_use_id")
            text = _tool_result_content(b.get("content"), f"{w}.content")
            if b.get("is_error") is True:
                text = "Error: " + text
            results.append({"role": "tool", "content": text, "tool_call_id": tid})
        else:
            raise _unsupported(kind, w)
    text = "\n".join(texts)
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        return "assistant", [turn], made
    return "user", results + ([{"role": "user", "content": text}] if texts or not results else []), made


def _history(raw: object, system: str | None) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("messages must be a non-empty array of {role, content}", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ProtocolError(f"messages has {len(raw)} entries, at most {MAX_MESSAGES}", "messages")
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    prev_role, prev_calls = "", set[str]()
    for i, m in enumerate(raw):
        role, turns, made = _turn(m, i, prev_calls)
        if i == 0 and role != "user":
            raise ProtocolError("messages[0].role must be 'user': a conversation starts with the user",
                                "messages[0].role")
        for t in turns:  # consecutive plain turns of one role are one turn, as Anthropic merges them
            last = out[-1] if out else None
            if last is not None and last["role"] == t["role"] and t["role"] in ROLES \
                    and "tool_calls" not in last and "tool_calls" not in t:
                out[-1] = {"role": t["role"], "content": last["content"] + "\n" + t["content"]}
            else:
                out.append(t)
        prev_role = role
        prev_calls = made if role == "assistant" else set()
    if prev_role != "user":
        raise ProtocolError(f"messages[{len(raw) - 1}] is an assistant turn: the conversation must end with a "
                            "user turn (continuing a partial assistant turn, prefill, is not supported)",
                            f"messages[{len(raw) - 1}].role")
    return out


def parse_tools(obj: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str, bool]:
    """``tools`` and ``tool_choice`` as chat's function tools and choice, and whether parallel calls
    are allowed (``disable_parallel_tool_use``)."""
    raw = obj.get("tools")
    tools: list[dict[str, Any]] = []
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise ProtocolError(f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
        for i, t in enumerate(raw):
            where = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ProtocolError(f"{where} must be {{name, description, input_schema}}", where)
            kind = t.get("type")
            if kind not in (None, "custom"):
                # a server tool (web search, code execution, ...) runs at Anthropic, not in a model
                # server: agents send them by default, so they are accepted and not offered
                if not isinstance(kind, str):
                    raise ProtocolError(f"{where}.type must be a string", f"{where}.type")
                continue
            name = t.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise ProtocolError(f"{where}.name must be 1-64 letters, digits, _ or -", f"{where}.name")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise ProtocolError(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
            if schema_depth(schema) > MAX_SCHEMA_DEPTH:
                raise ProtocolError(f"{where}.input_schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and "
                                    "arrays", f"{where}.input_schema")
            desc = t.get("description")
            if desc is not None and not isinstance(desc, str):
                raise ProtocolError(f"{where}.description must be a string", f"{where}.description")
            fn: dict[str, Any] = {"name": name, "parameters": schema}
            if desc is not None:
                fn["description"] = desc
            tools.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ProtocolError("tools has two tools with the same name", "tools")
    choice = obj.get("tool_choice")
    if choice is None:
        return tuple(tools), "auto" if tools else "none", True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ProtocolError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError("tool_choice.disable_parallel_tool_use must be a boolean",
                            "tool_choice.disable_parallel_tool_use")
    kind = choice["type"]
    if kind in ("any", "tool") and not tools:
        raise ProtocolError(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise ProtocolError(f"tool_choice names the tool {str(name)[:64]!r}, which is not in tools",
                                "tool_choice.name")
        return tuple(tools), str(name), parallel is not True
    return tuple(tools), {"auto": "auto", "any": "required", "none": "none"}[kind], parallel is not True


def _thinking(v: object) -> bool:
    """``thinking`` checked; whether the thinking text is shown (``display`` not ``omitted``)."""
    if v is None:
        return True
    if not isinstance(v, dict) or v.get("type") not in THINKING_TYPES:
        raise ProtocolError(f"thinking must be {{\"type\": one of {list(THINKING_TYPES)}}} (enabled with "
                            "budget_tokens)", "thinking")
    if v["type"] == "enabled":
        b = v.get("budget_tokens")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ProtocolError("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    display = v.get("display")
    if display not in (None, "summarized", "omitted"):
        raise ProtocolError("thinking.display must be 'summarized' or 'omitted'", "thinking.display")
    return display != "omitted"


def _output_format(v: object) -> str | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": {...}}``) as the JSON schema
    the grammar enforces (``guided_json``); ``output_config.effort`` is a hint, ignored."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ProtocolError("output_config must be an object", "output_config")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ProtocolError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                            "output_config.format")
    if schema_depth(fmt["schema"]) > MAX_SCHEMA_DEPTH:
        raise ProtocolError(f"output_config.format.schema nests more than {MAX_SCHEMA_DEPTH} levels of objects "
                            "and arrays", "output_config.format.schema")
    return json.dumps(fmt["schema"], ensure_ascii=False)


def parse_messages(obj: Any, count_only: bool = False) -> MessagesRequest:
    """``POST /v1/messages`` (``count_only``: ``/v1/messages/count_tokens``, where ``max_tokens``
    and the sampling fields do not apply). Raises :class:`ProtocolError` only."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type_name(obj)}")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("model is required (a non-empty string)", "model")
    max_tokens = 1 if count_only else int_field(obj, "max_tokens", 1)
    if max_tokens is None:
        raise ProtocolError("max_tokens is required (a positive integer)", "max_tokens")
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError(f"stream must be a boolean, got {type_name(stream)}", "stream")
    stop = obj.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
                             or not all(isinstance(s, str) for s in stop)):
        raise ProtocolError(f"stop_sequences must be an array of at most {MAX_STOP_SEQUENCES} strings",
                            "stop_sequences")
    meta = obj.get("metadata")
    if meta is not None and (not isinstance(meta, dict)
                             or not isinstance(meta.get("user_id", ""), (str, type(None)))):
        raise ProtocolError("metadata must be an object whose user_id is a string", "metadata")
    shown = _thinking(obj.get("thinking"))
    history = _history(obj.get("messages"), _system(obj.get("system")))
    tools, choice, parallel = parse_tools(obj)
    tool_turns = any("tool_calls" in h or h["role"] == "tool" for h in history)
    tool_req = ToolRequest(tools, choice, tuple(history)) if tools or tool_turns else None
    top_k = int_field(obj, "top_k", 0)
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": num_field(obj, "temperature"),
                              "top_p": num_field(obj, "top_p"), "top_k": top_k,
                              "seed": int_field(obj, "seed", 0),  # an extension, as on the OpenAI routes
                              "stop": tuple(s for s in stop or () if s),
                              "guided_json": _output_format(obj.get("output_config"))}
    try:
        sampling = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        field = next((k for k in sorted(kwargs, key=len, reverse=True) if msg.startswith(k)), None)
        field = {"stop": "stop_sequences", "guided_json": "output_config.format"}.get(field or "", field)
        raise ProtocolError(msg[:300], field) from None
    # plain turns for the template when no tool is involved (admission tokenizes them)
    msgs = tuple(ChatMessage(h["role"], h["content"]) for h in history)
    # max_tokens_given=False: clamped to the context, not refused (see the module docstring)
    g = Generate("", sampling, messages=msgs, model=model, max_tokens_given=False)
    return MessagesRequest(g, stream, tool_req, parallel, shown)
