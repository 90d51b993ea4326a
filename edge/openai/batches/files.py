"""``/v1/files``: upload (multipart, purpose ``batch``), list, retrieve, content, delete.

Contents are streamed from the request into memory up to ``EdgeConfig.max_file_bytes``
(``--max-file-bytes``; 413 beyond), then stored chunked on the bus
(:class:`~edge.openai.batches.store.BatchStore`); the app-wide JSON body limit does not apply to
uploads. Every object belongs to the tenant of the key that made it: another tenant's id is a 404.
"""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from edge.admission.gate import Admission
from edge.openai.batches.model import PURPOSES, UPLOAD_PURPOSES, FileObject, new_file_id
from edge.openai.batches.store import BatchStore
from edge.openai.reply import API, caller, error_response, json_response, refusal
from edge.request import ProtocolError

MAX_LIST = 10_000  # OpenAI's limit (and default) for files.list


def page(items: list[Any], query: Any, default: int, most: int, ident: Any) -> tuple[list[Any], bool]:
    """One page of ``items`` (already in list order) after the ``after`` id, at most ``limit``;
    and whether more follow. Raises :class:`ProtocolError` for a bad ``limit``."""
    try:
        limit = int(query.get("limit", default))
    except ValueError:
        raise ProtocolError("limit must be an integer", "limit") from None
    if not 1 <= limit <= most:
        raise ProtocolError(f"limit must be between 1 and {most}", "limit")
    after = query.get("after")
    if after:
        ids = [ident(i) for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


def listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


class FilesRoutes:
    def __init__(self, adm: Admission, store: BatchStore) -> None:
        self.adm = adm
        self.store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{id}", self.retrieve)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_delete("/v1/files/{id}", self.delete)

    def _missing(self, file_id: str) -> web.Response:
        self.adm.reject("not_found", API)
        return error_response("not_found", f"no file with id {file_id[:100]!r}", "file_id")

    def _get(self, request: web.Request) -> FileObject | web.Response:
        """The caller's file named in the path, or the refusal to answer with."""
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        f = self.store.file(who.tenant, request.match_info["id"])
        return f if f is not None else self._missing(request.match_info["id"])

    async def upload(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        try:
            purpose, filename, data = await self._read_form(request)
        except ProtocolError as exc:
            return refusal(self.adm, exc)
        f = await self.store.add_file(who.tenant, new_file_id(), filename, purpose, data)
        return json_response(200, f.api())

    async def _read_form(self, request: web.Request) -> tuple[str, str, bytes]:
        cap = self.adm.config.max_file_bytes
        if not request.content_type.startswith("multipart/"):
            raise ProtocolError("upload a file as multipart/form-data with fields 'file' and 'purpose'", "file")
        purpose: str | None = None
        filename, data = "", None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text())[:64]
            elif part.name == "file":
                filename = (part.filename or "upload.jsonl")[:256]
                buf = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    buf += chunk
                    if len(buf) > cap:
                        raise ProtocolError(f"the file is larger than {cap} bytes (--max-file-bytes)", "file",
                                            code="too_large")
                data = bytes(buf)
        if data is None:
            raise ProtocolError("the form has no 'file' field", "file")
        if purpose not in UPLOAD_PURPOSES:
            raise ProtocolError(f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}", "purpose")
        return purpose, filename, data

    async def list(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        purpose = request.query.get("purpose")
        order = request.query.get("order", "desc")
        try:
            if purpose is not None and purpose not in PURPOSES:
                raise ProtocolError(f"purpose must be one of {list(PURPOSES)}", "purpose")
            if order not in ("asc", "desc"):
                raise ProtocolError("order must be 'asc' or 'desc'", "order")
            files = sorted((f for f in self.store.files_of(who.tenant) if purpose in (None, f.purpose)),
                           key=lambda f: (f.created_at, f.id), reverse=order == "desc")
            got, more = page(files, request.query, MAX_LIST, MAX_LIST, lambda f: f.id)
        except ProtocolError as exc:
            return refusal(self.adm, exc)
        return json_response(200, listing([f.api() for f in got], more))

    async def retrieve(self, request: web.Request) -> web.Response:
        f = self._get(request)
        return f if isinstance(f, web.Response) else json_response(200, f.api())

    async def content(self, request: web.Request) -> web.Response:
        f = self._get(request)
        if isinstance(f, web.Response):
            return f
        return web.Response(status=200, body=await self.store.content(f), content_type="application/octet-stream")

    async def delete(self, request: web.Request) -> web.Response:
        f = self._get(request)
        if isinstance(f, web.Response):
            return f
        await self.store.delete_file(f)
        return json_response(200, {"id": f.id, "object": "file", "deleted": True})
