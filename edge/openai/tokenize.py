"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, with the served model's tokenizer.

``/tokenize`` takes ``prompt`` (a string; ``add_special_tokens`` default true, as a completion
prompt is tokenized) or ``messages`` (through the chat template; ``add_generation_prompt`` default
true, as a chat request is tokenized; ``add_special_tokens`` default false, the template writes
them) and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` when
``return_token_strs`` is true, else null). ``/detokenize`` takes ``tokens`` (ids below the
vocabulary size) and answers ``{"prompt"}``. ``model`` is optional, as in vLLM; when given it must
be the served model. Both need a key like every other route (dev mode: any or none). Nothing goes
to the bus: the edge holds the tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from edge.admission.gate import Admission
from edge.openai.reply import API, caller, check_model, error_response, json_response, read_json
from edge.openai.schema import MAX_PROMPT_IDS, parse_chat
from edge.request import PromptEncoder, ProtocolError

THREAD_CHARS = 8192  # inputs longer than this are tokenized off the event loop


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{name} must be a boolean", name)
    return v


def tokenize(encoder: PromptEncoder, body: Any) -> dict[str, Any]:
    """The ``/tokenize`` answer for a decoded body (model already checked). Pure but CPU-bound."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    tok = encoder.tokenizer
    has_prompt, has_msgs = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_msgs:
        raise ProtocolError("give exactly one of prompt (a string) or messages (a chat)",
                            "messages" if has_msgs else "prompt")
    gen = _flag(body, "add_generation_prompt", True)  # chat-only flags, checked either way
    cont = _flag(body, "continue_final_message", False)
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ProtocolError("prompt must be a string", "prompt")
        ids = list(tok(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))["input_ids"])
    else:
        # parse_chat checks the messages as chat does (roles, text parts: 400s naming messages[i])
        g = parse_chat({"model": "-", "messages": body["messages"]}, 1).generate
        msgs = [{"role": m.role, "content": m.content} for m in g.messages or ()]
        if gen and cont:
            raise ProtocolError("add_generation_prompt and continue_final_message cannot both be true",
                                "continue_final_message")
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen,
                                           continue_final_message=cont)
        except Exception as exc:  # the template refusing the chat is the input's fault
            raise ProtocolError(f"cannot apply the chat template: {str(exc)[:200]}", "messages") from None
        ids = list(tok(text, add_special_tokens=_flag(body, "add_special_tokens", False))["input_ids"])
    strs = tok.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": encoder.context_len, "tokens": ids, "token_strs": strs}


def detokenize(encoder: PromptEncoder, body: Any) -> dict[str, Any]:
    """The ``/detokenize`` answer for a decoded body (model already checked)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ProtocolError("tokens must be an array of token ids (integers)", "tokens")
    vocab = len(encoder.tokenizer)
    if len(ids) > MAX_PROMPT_IDS or any(t < 0 or t >= vocab for t in ids):
        raise ProtocolError(f"tokens must be ids in [0, {vocab}) (at most {MAX_PROMPT_IDS})", "tokens")
    return {"prompt": str(encoder.tokenizer.decode(ids))}


def _size(body: Any) -> int:
    if not isinstance(body, dict):
        return 0
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"])
    items = body.get("messages") or body.get("tokens") or ()
    # any JSON may arrive here (the shape is checked after this size guess): only a list has a length
    return len(items) * 64 if isinstance(items, list) else 0


class TokenizeRoutes:
    def __init__(self, adm: Admission) -> None:
        self.adm = adm

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, detokenize)

    async def _run(self, request: web.Request, fn: Any) -> web.Response:
        adm = self.adm
        who = caller(adm, request)
        if isinstance(who, web.Response):
            return who
        encoder = adm.encoder
        assert encoder is not None
        try:
            body = await read_json(adm, request)
            if isinstance(body, dict):
                check_model(adm, body, required=False)
                if isinstance(body.get("model"), str):  # another base model's tokenizer (docs/lora.md)
                    encoder = await adm.encoder_for(body["model"])
            if _size(body) > THREAD_CHARS:
                out = await asyncio.to_thread(fn, encoder, body)
            else:
                out = fn(encoder, body)
        except ProtocolError as exc:
            adm.reject(exc.code, API)
            return error_response(exc.code, exc.message, exc.field)
        return json_response(200, out)

