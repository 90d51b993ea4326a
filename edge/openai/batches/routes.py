"""``/v1/batches``: create, retrieve, list (newest first; ``after``, ``limit``), cancel; and the
service that owns the batch store and runner beside the OpenAI app (:class:`BatchService`).

Creating a batch checks the request (endpoint, completion window, metadata, an input file of the
caller's with purpose ``batch``) and stores the batch as ``validating``; the file's lines are
validated by the runner that takes it up (:mod:`edge.openai.batches.runner`), on whichever edge.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from edge.admission.gate import Admission
from edge.openai.batches.files import FilesRoutes, listing, page
from edge.openai.batches.model import ENDPOINTS, TERMINAL, WINDOWS, BatchObject, new_batch_id
from edge.openai.batches.runner import BatchRunner, Dispatch
from edge.openai.batches.store import BatchStore
from edge.openai.reply import API, caller, error_response, json_response, refusal
from edge.request import ProtocolError

MAX_LIST = 100
DEFAULT_LIST = 20


def check_metadata(raw: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > 16:
        raise ProtocolError("metadata must be an object of at most 16 key-value pairs", "metadata")
    for k, v in raw.items():
        if not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise ProtocolError("metadata keys must be strings of at most 64 characters and values strings of at "
                                "most 512", "metadata")
    return dict(raw)


class BatchesRoutes:
    def __init__(self, adm: Admission, store: BatchStore) -> None:
        self.adm = adm
        self.store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{id}", self.retrieve)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    def _missing(self, batch_id: str) -> web.Response:
        self.adm.reject("not_found", API)
        return error_response("not_found", f"no batch with id {batch_id[:100]!r}", "batch_id")

    async def create(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                raise ProtocolError("the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ProtocolError("the request body must be a JSON object")
            endpoint = body.get("endpoint")
            if endpoint not in ENDPOINTS:
                raise ProtocolError(f"endpoint must be one of {list(ENDPOINTS)}", "endpoint")
            window = body.get("completion_window")
            if window not in WINDOWS:
                raise ProtocolError(f"completion_window must be one of {list(WINDOWS)}", "completion_window")
            metadata = check_metadata(body.get("metadata"))
            fid = body.get("input_file_id")
            f = self.store.file(who.tenant, fid) if isinstance(fid, str) else None
            if f is None:
                raise ProtocolError(f"no file with id {str(fid)[:100]!r}", "input_file_id", code="not_found")
            if f.purpose != "batch":
                raise ProtocolError(f"the input file's purpose is {f.purpose!r}, not 'batch'", "input_file_id")
        except ProtocolError as exc:
            return refusal(self.adm, exc)
        now = int(time.time())
        b = BatchObject(new_batch_id(), who.tenant, who.entry.key_hash, endpoint, f.id, window, now,
                        now + WINDOWS[window], metadata=metadata)
        await self.store.put_batch(b)
        return json_response(200, b.api())

    async def retrieve(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        b = self.store.batch(request.match_info["id"], who.tenant)
        return json_response(200, self.store.view(b).api()) if b is not None else self._missing(request.match_info["id"])

    async def list(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        mine = sorted((b for b in self.store.all_batches() if b.tenant == who.tenant),
                      key=lambda b: (b.created_at, b.id), reverse=True)
        try:
            got, more = page(mine, request.query, DEFAULT_LIST, MAX_LIST, lambda b: b.id)
        except ProtocolError as exc:
            return refusal(self.adm, exc)
        return json_response(200, listing([self.store.view(b).api() for b in got], more))

    async def cancel(self, request: web.Request) -> web.Response:
        who = caller(self.adm, request)
        if isinstance(who, web.Response):
            return who
        b = self.store.batch(request.match_info["id"], who.tenant)
        if b is None:
            return self._missing(request.match_info["id"])
        if b.status in TERMINAL or b.status == "finalizing":
            self.adm.reject("conflict", API)
            return error_response("conflict", f"cannot cancel a batch whose status is {b.status!r}")
        await self.store.cancel(b.id)
        return json_response(200, self.store.view(b).api())


class BatchService:
    """The Files and Batches API of one edge: the store on the bus, the routes, the runner."""

    def __init__(self, adm: Admission, dispatch: Mapping[str, Dispatch]) -> None:
        self.store = BatchStore(adm.bus, adm.config.layout)
        self.files = FilesRoutes(adm, self.store)
        self.batches = BatchesRoutes(adm, self.store)
        self.runner = BatchRunner(adm, self.store, dispatch, adm.config.batch_max_in_flight)

    def add_to(self, app: web.Application) -> None:
        self.files.add_to(app)
        self.batches.add_to(app)

    async def start(self) -> None:
        await self.store.start()
        await self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        await self.store.stop()
