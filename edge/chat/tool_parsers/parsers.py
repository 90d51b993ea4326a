"""Tool-call formats: how a model writes a call in its output, how the edge reads it back into
OpenAI ``tool_calls``, and the grammar that forces a call (``tool_choice`` ``required`` / named).

* ``hermes`` (Hermes, Qwen, SmolLM2): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  possibly several, text around them is content.
* ``llama3_json`` (Llama 3.x): the output is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several joined by ``;``).
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any content.

The served model picks the parser (:func:`parser_for_model`); ``--tool-call-parser`` overrides it.
Pure (no I/O); the forcing grammar is built with xgrammar through ``tokenization.grammars``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenization.grammars import wrapped_json_grammar

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object (json.dumps of what the model wrote)


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# The head of a Hermes call up to its arguments' first character: what streaming needs to send the
# call's name before its arguments are complete.
HERMES_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def raw_arguments(body: str, call: ToolCall) -> ToolCall:
    """``call`` with its arguments as the model wrote them in ``body`` (``<tool_call>`` + the call's
    JSON), when they are the call object's last member; else as parsed (``json.dumps``). Streaming
    sends the raw text as it comes, so the non-streamed answer uses the same."""
    m = HERMES_HEAD.match(body)
    if m is None:
        return call
    end = body.rstrip().rfind("}")
    raw = body[m.end():end].rstrip()
    try:
        same = json.loads(raw) == json.loads(call.arguments)
    except json.JSONDecodeError:
        same = False
    return ToolCall(call.name, raw) if same else call


def _json_values(text: str, sep: str = "") -> list[Any] | None:
    """The JSON values ``text`` is made of (separated by whitespace and ``sep``), or ``None``."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """A JSON schema of one call to any of ``tools`` (OpenAI function tools): the name fixed, the
    arguments the function's parameter schema."""
    cases = [{"type": "object", "required": ["name", args_key],
              "properties": {"name": {"const": t["function"]["name"]},
                             args_key: t["function"].get("parameters") or {"type": "object", "properties": {}}}}
             for t in tools]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


class ToolParser:
    """One format. ``start``: the text that opens the calls (content before it streams as is)."""

    name = ""
    start = ""
    instruction = ""  # how to call, for the system prompt when the chat template ignores tools

    def render(self, calls: list[ToolCall]) -> str:
        """``calls`` as the model writes them (an assistant turn of the history, as text)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a complete output; no calls found: the text is all content."""
        raise NotImplementedError

    def forcing(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The wire ``guided_*`` fields that make the model call one of ``tools`` (arguments valid
        against the function's parameter schema)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    instruction = ("For each function call, return a JSON object with the function name and arguments within "
                   "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                   "<args-json-object>}\n</tool_call>")

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
                         for c in calls)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls: list[ToolCall] = []
        for m in self._CALL.finditer(text):
            body = m.group(1)
            try:
                value, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                return text, []  # a malformed call: the output is returned as text, not guessed at
            rest = body[end:].strip()
            closed = m.group(0).endswith("</tool_call>")
            # the output may end inside the closing tag (max_tokens): the JSON before it counts
            c = _call(value, ("arguments", "parameters")) if not rest or (not closed and "</tool_call>".startswith(rest)) \
                else None
            if c is None:
                return text, []
            calls.append(raw_arguments("<tool_call>" + body[:end], c))
        if not calls:
            return text, []
        content = self._CALL.sub("", text).strip()
        return content or None, calls

    def forcing(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"guided_grammar": wrapped_json_grammar("<tool_call>\n", call_schema(tools, "arguments"),
                                                       "\n</tool_call>")}


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    _TAG = "<|python_tag|>"
    instruction = ("To call a function, respond only with a JSON object of the form "
                   "{\"name\": <function-name>, \"parameters\": <args-json-object>}.")

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._TAG)
        if not body.lstrip().startswith("{"):
            return text, []
        values = _json_values(body, ";")
        calls = [_call(v, ("parameters", "arguments")) for v in values or ()]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def forcing(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"guided_json": json.dumps(call_schema(tools, "parameters"))}


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    instruction = ("To call functions, respond with [TOOL_CALLS] followed by a JSON array of objects "
                   "{\"name\": <function-name>, \"arguments\": <args-json-object>}.")

    def render(self, calls: list[ToolCall]) -> str:
        return self.start + "[" + ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}'
                                            for c in calls) + "]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        head, marker, tail = text.partition(self.start)
        if not marker:
            return text, []
        values = _json_values(tail)
        if not values or not isinstance(values[0], list) or len(values) != 1:
            return text, []
        calls = [_call(v, ("arguments", "parameters")) for v in values[0]]
        if not calls or any(c is None for c in calls):
            return text, []
        return head.strip() or None, [c for c in calls if c is not None]

    def forcing(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        schema = {"type": "array", "minItems": 1, "items": call_schema(tools, "arguments")}
        return {"guided_grammar": wrapped_json_grammar(self.start, schema, "")}


_BY_NAME: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                         "mistral": MistralParser}


def get_parser(name: str) -> ToolParser:
    try:
        return _BY_NAME[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}") from None


def parser_for_model(model: str) -> str:
    """The format a model family writes calls in (by its name or path); Hermes by default (SmolLM2,
    Qwen, Hermes and most ChatML models)."""
    m = model.lower()
    if "llama-3" in m or "llama3" in m:
        return "llama3_json"
    if "mistral" in m or "mixtral" in m:
        return "mistral"
    return "hermes"


def configured_parser(tool_call_parser: str | None, model: str, model_path: str | None) -> ToolParser:
    """The tool-call format of the OpenAI chat API: ``--tool-call-parser``, else the served model's."""
    return get_parser(tool_call_parser or parser_for_model(f"{model} {model_path or ''}"))
