"""OpenAI-compatible request bodies -> :class:`~edge.request.Generate`, and OpenAI error bodies.

Pure (no I/O). :func:`parse_chat` and :func:`parse_completion` take the decoded JSON body and
raise only :class:`~edge.request.ProtocolError` whose ``field`` is the OpenAI parameter name
(``messages[1].content``, ``temperature``, ...); the HTTP layer turns it into a 400 with that
``param``.

Policy on fields (see docs/protocol.md, "OpenAI-compatible API"):

* supported: OpenAI's sampling fields and vLLM's extras (``top_k``, ``ignore_eos``,
  ``stop_token_ids``); ``max_completion_tokens`` wins over ``max_tokens``; structured output
  (``response_format``, ``guided_*``: edge.guided); chat ``tools`` / ``tool_choice`` and tool turns
  (edge.chat.tools);
* refused with a 400 naming the field when set to something the platform cannot honour
  (``best_of`` > 1, ``suffix``, ``echo`` with ``logprobs``, ``functions``, ``tools`` on completions): silently
  ignoring them would return something the client did not ask for;
* unknown fields are ignored, as vLLM does: SDKs add optional fields faster than servers learn
  them, and an unknown field cannot change what a supported one means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bus import ChatMessage, ErrorCode, SamplingParams
from edge.chat.tools import ToolRequest, history_message, parse_tools
from edge.fields import bool_field, int_field, num_field, type_name
from edge.guided import FieldError, guided_fields
from edge.request import MAX_CACHE_SALT, MAX_MESSAGES, Generate, ProtocolError, requested_tier

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20
MAX_N = 8  # choices per request
MAX_PROMPT_IDS = 1 << 20
MAX_PROMPTS = 64  # prompts in one completions request
MAX_BATCH_CHOICES = 64  # prompts x n: requests on the bus for one HTTP request

# What each edge error code becomes over HTTP: (status, OpenAI error type, OpenAI error code).
HTTP_ERRORS: dict[str, tuple[int, str, str | None]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorCode.UNAUTHORIZED: (401, "invalid_request_error", "invalid_api_key"),
    "model_not_found": (404, "invalid_request_error", "model_not_found"),
    "not_found": (404, "invalid_request_error", "not_found"),
    "permission_denied": (403, "invalid_request_error", "permission_denied"),
    "conflict": (409, "invalid_request_error", "conflict"),  # a batch that can no longer be cancelled
    "too_large": (413, "invalid_request_error", "file_too_large"),  # an upload over --max-file-bytes
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.OVERLOADED: (503, "server_error", "overloaded"),
    ErrorCode.EXPIRED: (504, "server_error", "expired"),
    ErrorCode.INTERNAL: (500, "server_error", "internal"),
}


def error_body(code: str, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, ``{"error": {message, type, param, code}}``) for an edge error ``code``;
    codes forwarded from a worker that have no mapping are 500s carrying that code."""
    status, kind, oa_code = HTTP_ERRORS.get(code, (500, "server_error", code))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": oa_code}}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A failed request's answer: its HTTP status, OpenAI's error body, the ``Retry-After`` seconds."""

    status: int
    body: dict[str, Any]
    retry_after: float | None = None


def error_reply(code: str, message: str, retry_after: float | None = None, param: str | None = None) -> ErrorReply:
    """:func:`error_body` as an :class:`ErrorReply`: the one mapping of an edge error code (an
    admission refusal's, or a stream's :class:`~edge.admission.lifecycle.Failed`) to OpenAI's."""
    status, body = error_body(code, message, param)
    return ErrorReply(status, body, retry_after)


def openai_param(field: str | None, body: Any, format_key: str, format_param: str,
                 guided_fields: bool = True) -> str | None:
    """Admission's protocol-neutral field name in this API's words: the one place it is mapped. A
    ``guided_*`` constraint the body did not send as such (``guided_fields``: whether the API takes
    vLLM's ``guided_*`` fields at all) came from the API's output format (chat's
    ``response_format``, the Responses API's ``text.format``: ``format_key`` is its top-level key,
    ``format_param`` its name in errors) or, without one, from the forced tool choice (``tools``)."""
    if field is None or not field.startswith("guided_"):
        return field
    if guided_fields and isinstance(body, dict) and field in body:
        return field
    return format_param if isinstance(body, dict) and body.get(format_key) is not None else "tools"


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One parsed request. ``generate.model`` is the requested model (checked by the HTTP layer:
    404 when it is not served). ``logprobs``: ``None`` = not asked; else the number of
    alternatives per token (chat ``top_logprobs``, completions ``logprobs``)."""

    chat: bool
    generate: Generate
    stream: bool
    include_usage: bool
    logprobs: int | None
    tools: ToolRequest | None = None  # chat with tools or tool turns in the history (edge.chat.tools)
    n: int = 1  # choices: n requests on the bus, seeds seed, seed + 1, ... (edge.openai.routes)
    prompts: tuple[Generate, ...] = ()  # completions with a batch of prompts: each one's Generate (else empty)
    echo: bool = False  # completions: the prompt's text precedes each choice's
    parallel_tool_calls: bool = True  # chat with tools: false = the first call only (vLLM's reading)

    @property
    def batch(self) -> tuple[Generate, ...]:
        """Every prompt of the request (one for chat and single-prompt completions)."""
        return self.prompts or (self.generate,)


def _refuse(obj: dict, name: str, allowed: object, why: str) -> None:
    v = obj.get(name)
    if v is not None and v != allowed and not (isinstance(v, (list, dict)) and not v):
        raise ProtocolError(f"{name} is not supported: {why}", name)


def _common(obj: dict, default_max_tokens: int) -> tuple[SamplingParams, str, bool, bool, int]:
    """Sampling, model, stream, include_usage and n: the fields chat and completions share."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type_name(obj)}")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("model is required (a non-empty string)", "model")
    n = int_field(obj, "n", lo=1, hi=MAX_N) or 1
    _refuse(obj, "best_of", 1, "use n")
    _refuse(obj, "functions", None, "use tools")
    stream = bool_field(obj, "stream")
    opts = obj.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ProtocolError("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(opts, dict):
            raise ProtocolError(f"stream_options must be an object, got {type_name(opts)}", "stream_options")
        include_usage = bool_field(opts, "include_usage") if "include_usage" in opts else False
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise ProtocolError(f"user must be a string, got {type_name(user)}", "user")
    mct = int_field(obj, "max_completion_tokens", lo=1)
    mt = int_field(obj, "max_tokens", lo=1)
    max_tokens = mct if mct is not None else mt if mt is not None else default_max_tokens
    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is not None and (not isinstance(stop, list) or not all(isinstance(x, str) for x in stop)):
        raise ProtocolError("stop must be a string or an array of strings", "stop")
    stop_ids = obj.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise ProtocolError("stop_token_ids must be an array of integers", "stop_token_ids")
    top_k = int_field(obj, "top_k", lo=-1)
    seed = int_field(obj, "seed")
    if seed is not None and seed < 0:
        seed &= (1 << 63) - 1  # OpenAI seeds are signed 64-bit; the sampler's are not: same bits
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": num_field(obj, "temperature"), "top_p": num_field(obj, "top_p"),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM spells "off" -1
        "seed": seed, "stop": [s for s in stop or () if s], "stop_token_ids": stop_ids,
        "ignore_eos": bool_field(obj, "ignore_eos"),
        "presence_penalty": num_field(obj, "presence_penalty"), "frequency_penalty": num_field(obj, "frequency_penalty"),
        "logit_bias": _logit_bias(obj.get("logit_bias")),
        # vLLM's extras
        "min_p": num_field(obj, "min_p"), "repetition_penalty": num_field(obj, "repetition_penalty"),
        "min_tokens": int_field(obj, "min_tokens", lo=0),
    }
    try:  # structured output: response_format, vLLM's guided_* (edge.guided)
        kwargs.update(guided_fields(obj))
    except FieldError as exc:
        raise ProtocolError(exc.message, exc.field) from None
    try:
        sampling = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        field = next((k for k in sorted(kwargs, key=len, reverse=True) if msg.startswith(k)), None)
        if field is not None and field.startswith("guided_") and obj.get("response_format") is not None:
            field = "response_format"
        raise ProtocolError(msg[:300], field) from None
    return sampling, model, stream, include_usage, n


def _logit_bias(v: object) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"<token id>": bias}`` as the sampler's (id, bias) pairs (ranges checked there)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ProtocolError(f"logit_bias must be an object of token id -> bias, got {type_name(v)}", "logit_bias")
    out = []
    for k, b in v.items():
        if not k.isdigit() or len(k) > 12:
            raise ProtocolError(f"logit_bias keys must be token ids, got {k[:40]!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ProtocolError(f"logit_bias[{k}] must be a finite number", "logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


def _content(v: object, where: str) -> str:
    """A message's content: a string, or an array of text parts (concatenated)."""
    if v is None:
        return ""  # an assistant turn with tool calls only; tools are not supported, text is empty
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, p in enumerate(v):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ProtocolError(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                                    "other content types are not supported", f"{where}[{i}]")
            parts.append(p["text"])
        return "".join(parts)
    raise ProtocolError(f"{where} must be a string or an array of text parts, got {type_name(v)}", where)


def parse_chat(obj: Any, default_max_tokens: int) -> OpenAIRequest:
    """``POST /v1/chat/completions``. Raises :class:`ProtocolError` only."""
    sampling, model, stream, include_usage, n = _common(obj, default_max_tokens)
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("messages must be a non-empty array of {role, content}", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ProtocolError(f"messages has {len(raw)} entries, at most {MAX_MESSAGES}", "messages")
    msgs, history = [], []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ProtocolError(f"{where} must be an object, got {type_name(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ProtocolError(f"{where}.role must be one of {sorted(ROLES)}", f"{where}.role")
        msgs.append(ChatMessage(ROLES[role], _content(m.get("content"), f"{where}.content")))
        history.append(history_message(m, ROLES[role], msgs[-1].content, where))
    tools, choice = parse_tools(obj)
    tool_turns = any("tool_calls" in h or h["role"] == "tool" for h in history)
    tool_req = ToolRequest(tools, choice, tuple(history)) if tools or tool_turns else None
    logprobs = None
    top = int_field(obj, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if bool_field(obj, "logprobs"):
        logprobs = top or 0
    elif top:
        raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs is not None:
        sampling = _with_logprobs(sampling, logprobs)
    if n > 1 and tool_req is not None and tool_req.active:
        raise ProtocolError("n > 1 is not supported with tools", "n")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"parallel_tool_calls must be a boolean, got {type_name(parallel)}", "parallel_tool_calls")
    return OpenAIRequest(True, Generate("", sampling, messages=tuple(msgs), model=model, max_tokens_given=_given(obj),
                                        cache_salt=_salt(obj), tier=requested_tier(obj)),
                         stream, include_usage,
                         logprobs, tool_req, n, parallel_tool_calls=parallel is not False)


def _one_prompt(prompt: object, where: str) -> tuple[str | None, tuple[int, ...] | None]:
    """One completion prompt: a non-empty string, or a non-empty array of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError(f"{where} must not be empty", where)
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) > MAX_PROMPT_IDS or any(t < 0 for t in prompt):
            raise ProtocolError(f"{where} token ids must be non-negative (at most {MAX_PROMPT_IDS})", where)
        return None, tuple(prompt)
    raise ProtocolError(f"{where} must be a non-empty string or an array of token ids", where)


def parse_completion(obj: Any, default_max_tokens: int) -> OpenAIRequest:
    """``POST /v1/completions``. ``prompt`` is a string, an array of token ids, or an array of up
    to ``MAX_PROMPTS`` of those (a batch: choice ``i`` of prompt ``p`` has index ``p * n + i``, as
    OpenAI numbers them). ``echo`` puts the prompt's text before each choice's. Raises
    :class:`ProtocolError` only."""
    sampling, model, stream, include_usage, n = _common(obj, default_max_tokens)
    echo = bool_field(obj, "echo")
    _refuse(obj, "tools", None, "tools need /v1/chat/completions")
    _refuse(obj, "suffix", None, "this server does not do insertion (fill-in-the-middle); "
                                 "put the whole text in prompt")
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raw = prompt  # a batch (an array of strings, or of token-id arrays)
        if len(raw) > MAX_PROMPTS:
            raise ProtocolError(f"prompt has {len(raw)} prompts, at most {MAX_PROMPTS}", "prompt")
        if len({isinstance(p, str) for p in raw}) > 1:  # OpenAI's and vLLM's types: one kind per batch
            raise ProtocolError("prompt mixes strings and token-id arrays: a batch is all strings or all "
                                "token-id arrays", "prompt")
        parsed = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(raw)]
    else:
        parsed = [_one_prompt(prompt, "prompt")]
    if len(parsed) * n > MAX_BATCH_CHOICES:
        raise ProtocolError(f"{len(parsed)} prompts x n={n} is {len(parsed) * n} choices, "
                            f"at most {MAX_BATCH_CHOICES}", "n" if len(parsed) == 1 else "prompt")
    logprobs = int_field(obj, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if logprobs is not None:
        if echo:  # the prompt's own logprobs need a prompt-scoring pass the workers do not run
            raise ProtocolError("echo with logprobs is not supported (no prompt logprobs)", "echo")
        sampling = _with_logprobs(sampling, logprobs)
    salt, tier = _salt(obj), requested_tier(obj)
    gens = tuple(Generate("", sampling, prompt=text, model=model, prompt_token_ids=ids,
                          max_tokens_given=_given(obj), cache_salt=salt, tier=tier)
                 for text, ids in parsed)
    return OpenAIRequest(False, gens[0], stream, include_usage, logprobs, None, n,
                         prompts=gens if len(gens) > 1 else (), echo=echo)


def _given(obj: dict) -> bool:
    """Whether the client set the output limit itself (then a limit past the context is refused,
    as OpenAI and vLLM do, instead of clamped; edge.admission)."""
    return obj.get("max_completion_tokens") is not None or obj.get("max_tokens") is not None


def _salt(obj: dict) -> str | None:
    """vLLM's ``cache_salt`` extra: a prefix-cache namespace inside the tenant's own."""
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT):
        raise ProtocolError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                            "cache_salt")
    return salt


def _with_logprobs(sampling: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sampling, logprobs=n)
