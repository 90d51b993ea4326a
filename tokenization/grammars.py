"""Structured-output grammars (xgrammar), shared by the engine (which masks logits with them) and
the edge (which compiles each request's grammar once to refuse, with a 400, what cannot compile,
before it reaches the bus).

A constraint is a :data:`GuidedSpec` ``(kind, text)``: ``json`` (a JSON schema's text),
``json_object`` (any JSON object), ``regex``, ``choice`` (a JSON array of the strings) or
``grammar`` (EBNF, xgrammar's dialect). :class:`GrammarCache` compiles specs for one tokenizer on a
small thread pool and keeps them per spec. See docs/design-history.md, "Structured output".
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

GuidedSpec = tuple[str, str]  # (kind, text): the compile cache key
KINDS = ("json", "json_object", "regex", "choice", "grammar")

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def grammar_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix (``[23:39:24] /project/cpp/x.cc:94: ``)."""
    return _LOG_PREFIX.sub("", str(exc).strip())[:300]


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are valid
    xgrammar literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar 0.2.9 writes strings with maxLength/minLength as repetitions of this class, which lets
# raw control characters (U+0000..U+001F) into a JSON string; JSON forbids them unescaped.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str, *, strict: bool = True) -> xgr.Grammar:
    """A compact JSON grammar for ``schema`` (no optional whitespace: a sampled model cannot pad
    the output with it forever); ``strict``: no properties beyond the schema's."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _LOOSE_CHARS in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))
    return grammar


def build_grammar(spec: GuidedSpec) -> xgr.Grammar:
    """The grammar of ``spec``; ``ValueError`` naming the problem when it cannot be built."""
    kind, text = spec
    try:
        if kind == "json":
            return json_schema_grammar(text)
        if kind == "json_object":  # any object (the builtin JSON grammar also allows arrays, scalars)
            return json_schema_grammar('{"type": "object"}', strict=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"guided_{kind}: {grammar_error(exc)}") from None
    raise ValueError(f"unknown guided decoding kind {kind!r}")


class GrammarCache:
    """Compiles guided specs for one tokenizer; thread-safe. Results (and failures: they are
    deterministic) are kept per spec, least recently used dropped past ``max_entries``."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 threads: int = 2, max_entries: int = 512) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lockgate-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._max = max_entries

    def compile_async(self, spec: GuidedSpec) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar (done at once on a cache hit); it raises ``ValueError``
        naming the problem when the spec does not compile."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        return self.compile_async(spec).result()

    def _compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)
        try:
            return self.compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"guided_{spec[0]}: {grammar_error(exc)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def guided_spec(p: Any) -> GuidedSpec | None:
    """The spec of a sampling-params object with vLLM's ``guided_*`` fields (the wire's or the
    engine's), or ``None`` when it has no constraint."""
    if p.guided_json is not None:
        return ("json", p.guided_json)
    if p.guided_json_object:
        return ("json_object", "")
    if p.guided_regex is not None:
        return ("regex", p.guided_regex)
    if p.guided_choice is not None:
        return ("choice", json.dumps(list(p.guided_choice)))
    if p.guided_grammar is not None:
        return ("grammar", p.guided_grammar)
    return None


def wrapped_json_grammar(prefix: str, schema: dict[str, Any], suffix: str) -> str:
    """EBNF text (xgrammar's dialect) of ``prefix``, then a compact JSON value valid against
    ``schema``, then ``suffix``: how the edge forces a tool call in a model's call format."""
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}")] if prefix else []
    parts.append(json_schema_grammar(json.dumps(schema)))
    if suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
    return str(xgr.Grammar.concat(*parts)) if len(parts) > 1 else str(parts[0])
