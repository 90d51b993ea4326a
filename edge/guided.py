"""Structured output and sampling controls at the edge: the request fields both APIs share, and
the compile check that refuses a constraint the grammar engine cannot compile before it reaches
the bus.

Fields (docs/protocol.md): OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``)
and vLLM's ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice``,
``guided_grammar`` (EBNF), ``guided_json_object``; all become the wire's ``guided_*`` fields
(:class:`bus.messages.SamplingParams`). :class:`GrammarChecker` compiles each distinct constraint
once with xgrammar against the served tokenizer (off the event loop, cached), so a schema or regex
that cannot compile is a 400 naming the problem and the worker's compile is a cache-warm repeat.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import orjson

from bus import SamplingParams
from edge.fields import type_name
from tokenization.grammars import GrammarCache, guided_spec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object")
MAX_SCHEMA_DEPTH = 64  # JSON nesting of a schema: deeper is refused before the compiler recurses into it
KIND_FIELDS = {"json": "guided_json", "json_object": "guided_json_object", "regex": "guided_regex",
               "choice": "guided_choice", "grammar": "guided_grammar"}


class FieldError(ValueError):
    """A bad request field; ``field`` names it (the callers raise their protocol's error)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def schema_depth(v: object) -> int:
    """How deeply ``v`` nests arrays and objects (iterative: a hostile schema cannot exhaust the stack)."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d)
            if d <= MAX_SCHEMA_DEPTH:  # one level past the limit is enough to refuse
                stack.extend((y, d + 1) for y in x)
    return deepest


def schema_text(schema: object, field: str) -> str:
    """A JSON schema (an object, or its JSON text) as the wire's ``guided_json`` text, refused when
    it nests deeper than ``MAX_SCHEMA_DEPTH``."""
    parsed = schema
    if isinstance(schema, str):
        try:
            parsed = orjson.loads(schema)
        except orjson.JSONDecodeError:
            return schema  # not JSON: the compile check names the problem
    if schema_depth(parsed) > MAX_SCHEMA_DEPTH:
        raise FieldError(f"{field} nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays", field)
    return schema if isinstance(schema, str) else orjson.dumps(schema).decode()


def response_format(v: object) -> dict[str, Any]:
    """OpenAI's ``response_format`` as ``guided_*`` keyword arguments (empty for ``text``)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FieldError(f"response_format must be an object, got {type_name(v)}", "response_format")
    kind = v.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise FieldError("response_format.json_schema must be an object {name, schema, strict}",
                             "response_format.json_schema")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise FieldError("response_format.json_schema.name must be a string", "response_format.json_schema.name")
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise FieldError("response_format.json_schema.schema must be a JSON schema object",
                             "response_format.json_schema.schema")
        return {"guided_json": schema_text(schema, "response_format.json_schema.schema")}
    raise FieldError("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format.type")


def guided_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``guided_*`` fields of a request body as wire keyword arguments (type-checked; the
    wire ``SamplingParams`` checks sizes and that at most one is given)."""
    out: dict[str, Any] = {}
    gj = obj.get("guided_json")
    if gj is not None:
        if isinstance(gj, (dict, str)):
            out["guided_json"] = schema_text(gj, "guided_json")
        else:
            raise FieldError(f"guided_json must be a JSON schema object (or its JSON text), got {type_name(gj)}",
                             "guided_json")
    for name in ("guided_regex", "guided_grammar"):
        v = obj.get(name)
        if v is not None:
            if not isinstance(v, str):
                raise FieldError(f"{name} must be a string, got {type_name(v)}", name)
            out[name] = v
    choice = obj.get("guided_choice")
    if choice is not None:
        if not isinstance(choice, list) or not all(isinstance(c, str) for c in choice):
            raise FieldError("guided_choice must be an array of strings", "guided_choice")
        out["guided_choice"] = tuple(choice)
    gjo = obj.get("guided_json_object")
    if gjo is not None:
        if not isinstance(gjo, bool):
            raise FieldError(f"guided_json_object must be a boolean, got {type_name(gjo)}", "guided_json_object")
        out["guided_json_object"] = gjo
    fmt = response_format(obj.get("response_format"))
    if fmt and any(out.get(k) for k in GUIDED_FIELDS):
        raise FieldError("response_format and guided_* cannot be combined: give one constraint", "response_format")
    out.update(fmt)
    return out


def logit_bias(v: object) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"<token id>": bias}`` as the sampler's (id, bias) pairs (ranges checked by the
    wire ``SamplingParams``)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError(f"logit_bias must be an object of token id -> bias, got {type_name(v)}", "logit_bias")
    out = []
    for k, b in v.items():
        if not k.isdigit() or len(k) > 12:
            raise FieldError(f"logit_bias keys must be token ids, got {k[:40]!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise FieldError(f"logit_bias[{k}] must be a finite number", "logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


class GrammarChecker:
    """Compiles each request's constraint once against the served tokenizer (the xgrammar
    tokenizer info is built on first use, off the event loop). Thread-safe; cached per spec."""

    def __init__(self, tokenizer: Any, timeout_s: float = 5.0) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    def _grammars(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                self._cache = GrammarCache(self.tokenizer, len(self.tokenizer), [])
            return self._cache

    async def check(self, sampling: SamplingParams) -> str | None:
        """``None`` when the request's constraint compiles (or it has none); else the wire field
        and the problem, ``"guided_json: ..."``-style, as the error message."""
        spec = guided_spec(sampling)
        if spec is None:
            return None
        cache = self._cache if self._cache is not None else await asyncio.to_thread(self._grammars)
        try:
            # shielded: a timed-out compile runs on and stays cached (cancelling the pool's future
            # would leave a cancelled entry in the cache)
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cache.compile_async(spec))), self.timeout_s)
        except ValueError as exc:
            return str(exc)
        except TimeoutError:
            return (f"guided_{spec[0]}: the constraint did not compile within {self.timeout_s:g} s "
                    "(grammar_compile_timeout_s); simplify the schema or pattern")
        return None
