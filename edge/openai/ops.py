"""Probes and metrics on the OpenAI API's port, where load balancers and Kubernetes look for them:
``GET /health`` (liveness: 200 while the process serves, as vLLM's), ``GET /ready`` (200 while the
reply consumer is connected and a worker for the model sent a fresh heartbeat, else 503 with why:
the WebSocket port's ``/readyz``), ``GET /metrics`` (the edge's one Prometheus registry, the same
text as the WebSocket port's) and ``GET /version``. None needs a key: a probe carries none, and
none of them reveals more than the WebSocket port's own probes already do."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from aiohttp import web

from edge.admission.gate import Admission
from edge.metrics import CONTENT_TYPE
from edge.openai.reply import json_response

Readiness = Callable[[], tuple[bool, str]]


def _version() -> str:
    try:
        return importlib.metadata.version("lockgate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class OpsRoutes:
    """The four GET routes; ``readiness`` is the edge's (``Edge.readiness``)."""

    def __init__(self, adm: Admission, readiness: Readiness) -> None:
        self.adm = adm
        self.readiness = readiness
        self.version = _version()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.get_version)

    async def health(self, request: web.Request) -> web.Response:  # noqa: ARG002 - aiohttp's handler signature
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:  # noqa: ARG002
        ok, why = self.readiness()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def metrics(self, request: web.Request) -> web.Response:  # noqa: ARG002
        # CONTENT_TYPE carries a charset parameter, which aiohttp wants in the header, not content_type
        return web.Response(status=200, body=self.adm.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def get_version(self, request: web.Request) -> web.Response:  # noqa: ARG002
        return json_response(200, {"version": self.version})
