"""vLLM's run-time adapter endpoints: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (docs/lora.md, "At run time").

Bodies as vLLM's: ``{"lora_name": ..., "lora_path": ...}`` and ``{"lora_name": ...}``; lockgate
adds an optional ``base_model`` to the load (which base model's workers load it; default the
edge's own). Open to anyone in dev mode; with a key file only to keys marked ``"admin": true``
(403 otherwise). The edge loads nothing itself: :class:`~edge.admission.loras.RuntimeLoras` asks
the model's workers over the bus and answers with what they said: 200 and vLLM's plain-text
``Success: ...`` line, 400 naming a worker's reason (a missing folder, a malformed adapter), 404
for an unknown adapter or base model, 503 with no live worker to ask.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from edge.admission.gate import Admission
from edge.openai.reply import API, caller, error_response, read_json, refusal
from edge.request import ProtocolError


class LoraAdminRoutes:
    def __init__(self, adm: Admission) -> None:
        self.adm = adm

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The admin's JSON body, or the refusal to send."""
        adm = self.adm
        who = caller(adm, request)
        if isinstance(who, web.Response):
            return who
        if not adm.auth.dev_mode and not who.entry.admin:
            adm.reject("permission_denied", API)
            return error_response("permission_denied", "loading and unloading LoRA adapters needs an API key "
                                  "marked \"admin\": true in the key file")
        try:
            body = await read_json(adm, request)
            if not isinstance(body, dict):
                raise ProtocolError("the request body must be a JSON object")
            name = body.get("lora_name")
            if not isinstance(name, str) or not name.strip():
                raise ProtocolError("lora_name is required (a non-empty string)", "lora_name")
        except ProtocolError as exc:
            return refusal(self.adm, exc)
        return body

    async def load(self, request: web.Request) -> web.Response:
        adm = self.adm
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body["lora_name"], body.get("lora_path")
        base = body.get("base_model", adm.config.model)
        if not isinstance(path, str) or not path.strip():
            return refusal(adm, ProtocolError("lora_path is required (the adapter's folder as the workers see it)",
                                              "lora_path"))
        if base not in adm.models.bases:
            return refusal(adm, ProtocolError(f"base_model {str(base)[:200]!r} is not served here",
                                              "base_model", code="model_not_found"))
        if adm.serves(name):
            return refusal(adm, ProtocolError(f"The lora adapter {name!r} has already been loaded (or names a "
                                              "base model); unload it first", "lora_name"))
        out = await adm.loras.load(base, name, path)
        if out.code is not None:
            return refusal(adm, ProtocolError(out.message, "lora_path", code=out.code))
        return web.Response(text=out.message)

    async def unload(self, request: web.Request) -> web.Response:
        adm = self.adm
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name = body["lora_name"]
        target = adm.models.resolve(name)
        if target is None or target.lora is None:
            return refusal(adm, ProtocolError(f"The lora adapter {name!r} cannot be found.", "lora_name",
                                              code="not_found"))
        out = await adm.loras.unload(target.model, name)
        if out.code is not None:
            return refusal(adm, ProtocolError(out.message, "lora_name", code=out.code))
        return web.Response(text=out.message)
