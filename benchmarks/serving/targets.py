"""Where ``bench serve`` sends its requests: the edge over WebSocket, or the bus directly.

Both targets time one request the same way (``time.perf_counter``): ``sent_at`` just before the
request leaves, one ``chunk_times`` entry per reply chunk carrying tokens (a WebSocket ``delta``
frame, which the edge may coalesce from several tokens; a bus ``TokenChunk``), ``done_at`` when the
``done``/``Finished`` arrives.

* :class:`WsTarget` follows ``docs/protocol.md``: ``generate`` frames with a client ``id``,
  replies ``accepted`` / ``delta`` / ``done`` / ``error``. It keeps a few persistent connections
  per tier (one API key per tier; the edge derives the tier from the key) and multiplexes requests
  on them; one reader task per connection routes frames by ``id`` to the waiting request.
* :class:`OpenAITarget` drives any OpenAI-compatible server (``--openai-url http://host:port/v1``):
  streaming chat completions, SSE parsed by hand (no SDK in the timing path).
* :class:`BusTarget` publishes :class:`InferenceRequest` s on the priority topics and reads its
  own reply topic (:class:`~producers.collector.ReplyCollector`) — no edge in the path.

Cancellation: ``stop()`` cancels the reader tasks and closes the connections; requests waiting on
a closed connection fail with ``error="disconnected"``. ``run_one`` is cancellable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass

import aiohttp
import orjson

from bus import InferenceRequest, SamplingParams, encode
from producers.collector import ReplyCollector
from producers.timing import RequestTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request to send: text for the edge, exact token ids for the bus."""

    index: int
    tier: int
    text: str
    token_ids: tuple[int, ...]
    max_tokens: int


def sampling_for(max_tokens: int) -> SamplingParams:
    # Like vLLM's benchmark: greedy, ignore EOS, so every request produces exactly max_tokens.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _Conn:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.waiting: dict[str, asyncio.Queue] = {}
        self.task: asyncio.Task | None = None

    async def read(self) -> None:
        try:
            async for raw in self.ws:
                frame = orjson.loads(raw)
                q = self.waiting.get(frame.get("id"))
                if q is not None:
                    q.put_nowait((time.perf_counter(), frame))
        except Exception as exc:
            log.debug("connection reader ended: %s", exc)
        finally:
            for q in self.waiting.values():
                q.put_nowait((time.perf_counter(), {"type": "error", "code": "disconnected", "message": "closed"}))


class WsTarget:
    def __init__(self, url: str, keys: dict[int, str | None], connections_per_tier: int = 4,
                 open_timeout_s: float = 10.0) -> None:
        if not keys:
            raise ValueError("WsTarget needs at least one tier -> API key entry")
        self.url = url
        self.keys = keys
        self.per_tier = connections_per_tier
        self.open_timeout_s = open_timeout_s
        self.conns: dict[int, list[_Conn]] = {}
        self._rr: dict[int, itertools.cycle] = {}
        self._ids = itertools.count()

    @property
    def tiers(self) -> tuple[int, ...]:
        return tuple(sorted(self.keys))

    async def start(self) -> None:
        from websockets.asyncio.client import connect

        loop = asyncio.get_running_loop()
        for tier, key in self.keys.items():
            conns = []
            for _ in range(self.per_tier):
                headers = {"Authorization": f"Bearer {key}"} if key else None
                ws = await connect(self.url, additional_headers=headers, open_timeout=self.open_timeout_s,
                                   max_size=None, ping_interval=None, compression=None)
                c = _Conn(ws)
                c.task = loop.create_task(c.read(), name="bench-ws-reader")
                conns.append(c)
            self.conns[tier] = conns
            self._rr[tier] = itertools.cycle(conns)

    async def stop(self) -> None:
        for conns in self.conns.values():
            for c in conns:
                await c.ws.close()
                if c.task is not None:
                    c.task.cancel()
                    await asyncio.gather(c.task, return_exceptions=True)
        self.conns.clear()

    async def run_one(self, p: Prompt) -> RequestTiming:
        tier = p.tier if p.tier in self.conns else self.tiers[0]
        conn = next(self._rr[tier])
        cid = f"b{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        conn.waiting[cid] = q
        frame = {"type": "generate", "id": cid, "prompt": p.text, "max_tokens": p.max_tokens,
                 "temperature": 0.0, "ignore_eos": True}
        chunks: list[float] = []
        prompt_tokens = 0
        try:
            sent = time.perf_counter()
            await conn.ws.send(orjson.dumps(frame).decode())
            while True:
                at, f = await q.get()
                kind = f.get("type")
                if kind == "accepted":
                    prompt_tokens = int(f.get("prompt_tokens", 0))
                elif kind == "delta":
                    chunks.append(at)
                elif kind == "done":
                    usage = f.get("usage") or {}
                    n = int(usage.get("completion_tokens", len(chunks)))
                    ok = f.get("finish_reason") != "abort"
                    return RequestTiming(sent, tuple(chunks), at, n, int(usage.get("prompt_tokens", prompt_tokens)),
                                         tier, ok, None if ok else "abort")
                elif kind == "error":
                    return RequestTiming(sent, tuple(chunks), at, 0, prompt_tokens, tier, False,
                                         str(f.get("code", "error")))
        finally:
            conn.waiting.pop(cid, None)


class BusTarget:
    def __init__(self, bus, model: str, layout=None) -> None:
        from bus import TopicLayout

        self.bus = bus
        self.model = model
        self.layout = layout or TopicLayout()
        self.owner = f"bench-{secrets.token_hex(4)}"
        self.collector: ReplyCollector | None = None
        self._ids = itertools.count()

    tiers = (0, 1, 2)

    async def start(self) -> None:
        await self.bus.ensure_topics(self.layout.model_specs(self.model) + [self.layout.reply_spec(self.owner)])
        self.collector = ReplyCollector(self.bus, self.layout.reply_topic(self.owner), start_from="latest")
        await self.collector.start()

    async def stop(self) -> None:
        if self.collector is not None:
            await self.collector.retire()  # this run's reply topic, unless a request may still answer

    async def run_one(self, p: Prompt) -> RequestTiming:
        assert self.collector is not None
        rid = f"{self.owner}-{next(self._ids)}"
        req = InferenceRequest(request_id=rid, model=self.model, prompt_token_ids=p.token_ids,
                               sampling=sampling_for(p.max_tokens).seeded(), reply_to=self.collector.topic,
                               tenant="bench", tier=p.tier, enqueued_at=time.time())
        fut = self.collector.expect(rid)
        try:
            sent = time.perf_counter()
            await self.bus.send(self.layout.request_topic(self.model, p.tier), encode(req), key=rid.encode())
            r = await fut
        finally:
            self.collector.forget(rid)
        ok = r.ok and r.finished is not None and r.finished.finish_reason != "abort"
        return RequestTiming(sent, r.chunk_times, r.done_at, len(r.token_ids), len(p.token_ids), p.tier, ok,
                             None if ok else (r.error.code if r.error else "abort"))


class OpenAITarget:
    """Any OpenAI-compatible server (lockgate's ``/v1``, vLLM, ...): streaming chat completions with
    ``stream_options.include_usage`` (token counts from the server's usage chunk) and vLLM's
    ``ignore_eos`` extra with ``max_tokens``, so each request produces exactly its output length on
    servers that honour it. One ``chunk_times`` entry per SSE event carrying content. ``keys`` maps
    tiers to bearer keys (``None``: no key, e.g. a dev-mode edge). The served model is the first
    entry of ``GET /models`` unless ``model`` is given."""

    def __init__(self, base_url: str, keys: dict[int, str | None], model: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.keys = keys or {1: None}
        self.model = model
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None

    @property
    def tiers(self) -> tuple[int, ...]:
        return tuple(sorted(self.keys))

    def _headers(self, tier: int) -> dict[str, str]:
        key = self.keys.get(tier, self.keys[self.tiers[0]])
        return {"Authorization": f"Bearer {key or 'none'}"}

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        if self.model is None:
            async with self.session.get(f"{self.base_url}/models", headers=self._headers(self.tiers[0])) as r:
                data = (await r.json())["data"]
            if not data:
                raise RuntimeError(f"{self.base_url}/models lists no model (no live worker?)")
            self.model = data[0]["id"]

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def run_one(self, p: Prompt) -> RequestTiming:
        assert self.session is not None, "start() first"
        tier = p.tier if p.tier in self.keys else self.tiers[0]
        body = {"model": self.model, "messages": [{"role": "user", "content": p.text}], "max_tokens": p.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks: list[float] = []
        usage: dict = {}
        sent = time.perf_counter()
        async with self.session.post(f"{self.base_url}/chat/completions", json=body,
                                     headers=self._headers(tier)) as r:
            if r.status != 200:
                err: dict = {}
                with contextlib.suppress(Exception):
                    err = (await r.json()).get("error") or {}
                return RequestTiming(sent, (), time.perf_counter(), 0, 0, tier, False,
                                     str(err.get("code") or f"http_{r.status}"))
            buf = b""
            async for data in r.content.iter_any():
                at = time.perf_counter()
                buf += data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    payload = ev.removeprefix(b"data: ")
                    if payload == b"[DONE]":
                        n = int(usage.get("completion_tokens", len(chunks)))
                        return RequestTiming(sent, tuple(chunks), at, n, int(usage.get("prompt_tokens", 0)), tier,
                                             True, None)
                    obj = orjson.loads(payload)
                    if "error" in obj:
                        return RequestTiming(sent, tuple(chunks), at, 0, 0, tier, False,
                                             str(obj["error"].get("code") or "error"))
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for c in obj.get("choices") or ():
                        if (c.get("delta") or {}).get("content"):
                            chunks.append(at)
        return RequestTiming(sent, tuple(chunks), time.perf_counter(), 0, 0, tier, False, "disconnected")
