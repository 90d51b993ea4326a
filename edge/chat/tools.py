"""Tool calling on ``/v1/chat/completions``: the request fields (``tools``, ``tool_choice``, history
turns with ``tool_calls`` and ``tool`` results), the prompt (the model's chat template, or a
Hermes-style system prompt when the template ignores tools), the forcing grammar for
``tool_choice`` ``required`` / named, and the output read back into OpenAI ``tool_calls``
(:class:`ToolStream`, incremental for SSE). The call format is the served model's
(:mod:`edge.chat.tool_parsers`). See docs/protocol.md, "Tool calling".
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from edge.chat.tool_parsers import HERMES_HEAD, ToolCall, ToolParser
from edge.guided import MAX_SCHEMA_DEPTH, schema_depth
from edge.request import Generate, PromptEncoder, ProtocolError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ARG_FRAGMENT_CHARS = 16  # streamed arguments come in fragments of this many characters

FALLBACK_SYSTEM = ("You are a function calling AI model. You are provided with function signatures within "
                   "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
                   "Don't make assumptions about what values to plug into functions. Here are the available "
                   "tools: <tools>{tools}</tools>\n{instruction}")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """``tools`` (OpenAI function tools, checked), ``choice`` (``auto``, ``none``, ``required`` or a
    function name) and the history as template dicts (``tool_calls`` / ``tool_call_id`` kept)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    messages: tuple[dict[str, Any], ...]

    @property
    def active(self) -> bool:
        """Tools are offered (and the output is read for calls)."""
        return bool(self.tools) and self.choice != "none"


def _err(msg: str, field: str) -> ProtocolError:
    return ProtocolError(msg, field)


def parse_tools(obj: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str]:
    """``tools`` and ``tool_choice`` of a chat body (400s naming the field)."""
    raw = obj.get("tools")
    tools: list[dict[str, Any]] = []
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise _err(f"tools must be an array of at most {MAX_TOOLS} function tools", "tools")
        for i, t in enumerate(raw):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise _err(f'{where} must be {{"type": "function", "function": {{name, description, parameters}}}}', where)
            fn = t["function"]
            if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
                raise _err(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise _err(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
            if params is not None and schema_depth(params) > MAX_SCHEMA_DEPTH:
                raise _err(f"{where}.function.parameters nests more than {MAX_SCHEMA_DEPTH} levels of objects and "
                           "arrays", f"{where}.function.parameters")
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise _err(f"{where}.function.description must be a string", f"{where}.function.description")
            tools.append({"type": "function", "function": {k: v for k, v in fn.items()
                                                           if k in ("name", "description", "parameters")}})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _err("tools has two functions with the same name", "tools")
    choice = obj.get("tool_choice")
    if choice is None:
        return tuple(tools), "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _err("tool_choice 'required' needs tools", "tool_choice")
        return tuple(tools), choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _err(f"tool_choice names the function {str(name)[:64]!r}, which is not in tools", "tool_choice")
        return tuple(tools), str(name)
    raise _err("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}",
               "tool_choice")


def history_message(m: dict[str, Any], role: str, content: str, where: str) -> dict[str, Any]:
    """One history turn as a template dict, keeping an assistant's ``tool_calls`` (arguments as
    objects, as chat templates expect) and a tool result's ``tool_call_id``."""
    out: dict[str, Any] = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None and role == "assistant":
        if not isinstance(calls, list):
            raise _err(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        norm = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                raise _err(f"{where}.tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}",
                           f"{where}.tool_calls[{j}]")
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                raise _err(f"{where}.tool_calls[{j}].function.arguments must be JSON text",
                           f"{where}.tool_calls[{j}].function.arguments") from None
            norm.append({"id": str(c.get("id") or ""), "type": "function",
                         "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = norm
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


# --- the prompt ---------------------------------------------------------------------------------

_NATIVE: dict[int, bool] = {}  # id(tokenizer) -> its chat template renders tools


def template_renders_tools(tokenizer: Any) -> bool:
    key = id(tokenizer)
    if key not in _NATIVE:
        probe = [{"role": "user", "content": "x"}]
        tool = {"type": "function", "function": {"name": "probe_fn", "description": "d", "parameters": {"type": "object"}}}
        try:
            with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
            _NATIVE[key] = "probe_fn" in with_tools
        except Exception:  # a template that refuses tools does not render them
            _NATIVE[key] = False
    return _NATIVE[key]


def _fallback_messages(tr: ToolRequest, parser: ToolParser, with_tools: bool) -> list[dict[str, Any]]:
    """The history in text form: calls as the model writes them, results in ``<tool_response>``
    (Hermes), the tools in a system prompt."""
    out: list[dict[str, Any]] = []
    for m in tr.messages:
        content = m["content"]
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                     for c in m["tool_calls"]]
            content = (content + "\n" if content else "") + parser.render(calls)
        elif m["role"] == "tool" and parser.name == "hermes":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if with_tools:
        system = FALLBACK_SYSTEM.format(tools=json.dumps(list(tr.tools), ensure_ascii=False),
                                        instruction=parser.instruction)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def render_prompt(encoder: PromptEncoder, tr: ToolRequest, parser: ToolParser) -> list[int]:
    """Token ids of the conversation with the tools (unless ``tool_choice`` is ``none``)."""
    tok = encoder.tokenizer
    with_tools = tr.active
    try:
        if template_renders_tools(tok):
            kw = {"tools": list(tr.tools)} if with_tools else {}
            text = tok.apply_chat_template(list(tr.messages), tokenize=False, add_generation_prompt=True, **kw)
        else:
            text = tok.apply_chat_template(_fallback_messages(tr, parser, with_tools), tokenize=False,
                                           add_generation_prompt=True)
    except Exception as exc:  # template errors are the input's fault
        raise _err(f"cannot render messages with the chat template: {str(exc)[:200]}", "messages") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


def prepare(g: Generate, tr: ToolRequest, encoder: PromptEncoder, parser: ToolParser) -> Generate:
    """``g`` with the rendered prompt ids and, for ``required`` / a named function, the grammar
    that forces a call (one call, arguments valid against the function's parameters)."""
    ids = render_prompt(encoder, tr, parser)
    sampling = g.sampling
    if tr.choice not in ("auto", "none"):
        if sampling.guided:
            raise _err("tool_choice 'required' or a named function cannot be combined with response_format or "
                       "guided_*", "tool_choice")
        tools = [t for t in tr.tools if tr.choice == "required" or t["function"]["name"] == tr.choice]
        try:
            forcing = parser.forcing(tools)
        except (RuntimeError, ValueError) as exc:
            raise _err(f"cannot build the tool-call grammar: {str(exc)[:200]}", "tools") from None
        sampling = replace(sampling, **forcing)
    return replace(g, prompt_token_ids=tuple(ids), sampling=sampling)


# --- the output ---------------------------------------------------------------------------------

def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def message_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a non-streamed answer."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ToolStream:
    """Reads a streamed output for tool calls. ``feed`` returns the deltas to send now: content up
    to where a call may start; for a Hermes call, its id and name as soon as they are read, then its
    arguments as they are generated (all but a possibly-closing ``}``); for the other formats, each
    call once the output is complete (id and name, then its arguments in fragments). ``finish``
    returns the rest. ``calls`` counts the calls sent."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.in_calls = False
        self.calls = 0
        self.any_content = False
        self._open = False  # a Hermes call's head is sent, its arguments are streaming
        self._sent = ""  # the arguments text sent for the open call

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        if not self.in_calls:
            start = self.parser.start
            if self.parser.name == "llama3_json":  # a call is the whole output: it starts with "{"
                head = self.buf.lstrip()
                if not self.any_content and (head.startswith("{") or head.startswith("<|python_tag|>")):
                    self.in_calls = True
                elif head and not ("<|python_tag|>".startswith(head) and not self.any_content):
                    out.append({"content": self.buf})
                    self.any_content, self.buf = True, ""
                return out
            idx = self.buf.find(start)
            if idx < 0:
                keep = next((n for n in range(min(len(start) - 1, len(self.buf)), 0, -1)
                             if start.startswith(self.buf[-n:])), 0)
                emit, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if emit:
                    out.append({"content": emit})
                    self.any_content = True
                return out
            if idx:
                out.append({"content": self.buf[:idx]})
                self.any_content = True
            self.buf, self.in_calls = self.buf[idx:], True
        if self.parser.name == "hermes":
            while (end := self.buf.find("</tool_call>")) >= 0:  # a call closed
                out += self._partial()
                block, self.buf = self.buf[: end + len("</tool_call>")], self.buf[end + len("</tool_call>"):]
                out += self._close(block)
            out += self._partial()
        return out

    def _partial(self) -> list[dict[str, Any]]:
        """The open Hermes call's head, and the arguments generated so far."""
        m = HERMES_HEAD.search(self.buf)
        if m is None:
            return []
        out: list[dict[str, Any]] = []
        if not self._open:
            self._open, self._sent = True, ""
            out.append({"tool_calls": [{"index": self.calls, "id": call_id(), "type": "function",
                                        "function": {"name": m.group(1), "arguments": ""}}]})
            self.calls += 1
        region = self.buf[m.end():]
        cut = region.rfind("}")  # the last "}" may close the call object: held back until more comes
        upto = (region[:cut] if cut >= 0 else region).rstrip()
        if len(upto) > len(self._sent) and upto.startswith(self._sent):
            out.append(self._args(upto[len(self._sent):]))
            self._sent = upto
        return out

    def _close(self, block: str) -> list[dict[str, Any]]:
        """A complete ``<tool_call>`` block: the rest of the open call's arguments (or the whole
        call when its head was not recognised while streaming; the text when it does not parse)."""
        _, calls = self.parser.parse(block)
        out: list[dict[str, Any]] = []
        if self._open:
            self._open = False
            if calls and calls[0].arguments.startswith(self._sent) and len(calls[0].arguments) > len(self._sent):
                out.append(self._args(calls[0].arguments[len(self._sent):]))
            calls = calls[1:]
        elif not calls:
            return [{"content": block}]
        return out + self._call_deltas(calls)

    def _args(self, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": fragment}}]}

    def finish(self) -> list[dict[str, Any]]:
        if not self.buf.strip():
            return []
        if self._open:  # the output ended inside a call (max_tokens): the rest of what parses
            block, self.buf = self.buf, ""
            return self._close(block)
        content, calls = self.parser.parse(self.buf) if self.in_calls else (self.buf, [])
        self.buf = ""
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        return out + self._call_deltas(calls)

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for c in calls:
            i = self.calls
            self.calls += 1
            out.append({"tool_calls": [{"index": i, "id": call_id(), "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            for k in range(0, len(c.arguments), ARG_FRAGMENT_CHARS):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments[k:k + ARG_FRAGMENT_CHARS]}}]})
        return out
