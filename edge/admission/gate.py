"""Admission: the ONE path by which a request of either API (WebSocket ``ws``, OpenAI HTTP
``openai``) gets onto the bus, and the one way its stream ends.

:class:`Admission` owns what both protocols share: the key check (:class:`~edge.admission.auth.Authenticator`),
per-key rate limits, load shedding from worker heartbeats, prompt tokenization, request ids, the
reply router registration, the request topic publish, the Cancel outbox and the request metrics.
A protocol front end (``edge.ws.session.Session``, ``edge.openai.routes``) parses its own wire format
into a :class:`~edge.request.Generate`, opens an :class:`~edge.admission.lifecycle.OwnedStreams`
(:meth:`Admission.streams`), calls :meth:`Admission.admit` (which raises
:class:`~edge.request.ProtocolError` with the protocol-neutral code and field), tells its client
the request was accepted, then :meth:`Admission.publish`. From admission on, the stream's counting
and its one end (refund, unregister, optional Cancel) belong to the
:class:`~edge.admission.lifecycle.Lifecycle`; the front end's sink only turns what the lifecycle
hands it into frames or SSE bytes.

Nothing here knows WebSockets or HTTP; the edge server composes it with both listeners.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from bus import Bus, BusError, Cancel, ErrorCode, InferenceRequest, bound, encode
from edge.admission.affinity import Placement, PrefixAffinity
from edge.admission.auth import Authenticator, Principal
from edge.admission.fleet import FleetLimits
from edge.admission.lifecycle import Lifecycle, OwnedStreams, Stream, StreamSink
from edge.admission.loras import RuntimeLoras
from edge.admission.models import ModelCatalog
from edge.admission.ratelimit import RateLimiter
from edge.admission.resumable import StreamDirectory
from edge.admission.router import ReplyRouter
from edge.admission.shedding import LoadShedder
from edge.config import EdgeConfig
from edge.guided import GrammarChecker
from edge.metrics import EdgeMetrics
from edge.request import Generate, PromptEncoder, ProtocolError
from tracing import HEADER, STATE_HEADER, SpanContext, SpanKind, Tracer, parse_headers, to_headers

log = logging.getLogger(__name__)

CANCEL_OUTBOX = 65536
THREAD_TOKENIZE_CHARS = 8192  # prompts longer than this are tokenized off the event loop


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission: its stream is registered with the router (replies are
    routed from now on), the request is not published yet (:meth:`Admission.publish`)."""

    stream: Stream
    request: InferenceRequest


class Admission:
    def __init__(self, config: EdgeConfig, bus: Bus, encoder: PromptEncoder | None, metrics: EdgeMetrics,
                 reply_topic: str, tracer: Tracer | None = None) -> None:
        self.config = config
        self.tracer = tracer  # None: tracing off, no span is built (docs/observability.md, "Tracing")
        self.bus = bus
        self.metrics = metrics
        self.reply_topic = reply_topic
        # Request ids: edge id, a random per-process nonce, a counter. The nonce keeps ids unique
        # across restarts of an edge with a fixed --edge-id and across --reuse-port processes
        # sharing one: a repeated id would be aborted by a worker's cancelled-set or routed to
        # another client's stream. The same pair names this process in the fleet's heartbeats.
        self._nonce = secrets.token_hex(4)
        self.fleet = FleetLimits(f"{config.edge_id}-{self._nonce}", config.fleet_edge_stale_s, config.keys) \
            if config.fleet_limits and not config.dev_mode else None
        self.limiter = RateLimiter(self.fleet)
        # the base models and adapters a request may name, their heartbeats and tokenizers
        self.models = ModelCatalog(config, encoder)
        self.shedder: LoadShedder = self.models.shedders[config.model]  # the edge's own model's
        self.auth = Authenticator(config.keys, config.dev_tier)
        self.lifecycle = Lifecycle(metrics, self.limiter, self.publish_cancel)
        self.router = ReplyRouter(bus, reply_topic, metrics, self.lifecycle)
        self.loras = self.models.runtime = RuntimeLoras(
            bus, config.layout.control_topic, reply_topic, config.edge_id, config.lora_load_timeout_s,
            lambda m: self.models.shedders[m].serving(time.monotonic()) if m in self.models.shedders else [])
        self.router.on_lora_ack = self.loras.on_ack
        self._ids = itertools.count()
        self._cancels: asyncio.Queue[Cancel] | None = None
        self._grammars: GrammarChecker | None = None  # structured-output compile check, on first use
        self.placement = Placement(bus, PrefixAffinity(config.affinity_tokens) if config.prefix_affinity else None)
        # resumable streams: where other edges find them (set by the edge's start), and their owner
        # here, never left (they outlive their connection: edge.admission.resumable)
        self.directory: StreamDirectory | None = None
        self.resumables = OwnedStreams(self.lifecycle)

    @property
    def encoder(self) -> PromptEncoder | None:
        """The edge's own model's tokenizer (set by the edge's start() when it loads it itself)."""
        return self.models.encoders.get(self.config.model)

    @encoder.setter
    def encoder(self, encoder: PromptEncoder) -> None:
        self.models.encoders[self.config.model] = encoder

    # --- requests -----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"{self.config.edge_id}-{self._nonce}-{next(self._ids):x}"

    def reject(self, code: str, api: str) -> None:
        self.metrics.rejections.labels(code, api).inc()

    def streams(self) -> OwnedStreams:
        """A handler's owner of the streams it admits: ``with adm.streams() as owned:`` cancels
        (reason ``disconnect``) every one still open when the block is left."""
        return OwnedStreams(self.lifecycle)

    async def admit(self, g: Generate, principal: Principal, sink: StreamSink, api: str, owner: OwnedStreams, *,
                    client_id: str | None = None, token_ids: bool = False,
                    gone: Callable[[], bool] = lambda: False,
                    trace_parent: SpanContext | None = None) -> Admitted | None:
        """Check, tokenize, charge and register one request, owned by ``owner``. Raises
        :class:`ProtocolError` (codes ``invalid_request``, ``overloaded``, ``rate_limited``);
        ``None`` when ``gone()`` says the client left while the prompt was being tokenized
        (nothing was charged).
        ``trace_parent``: the client's trace context (:meth:`trace_parent`); the request's span is
        its child, else the root of a new trace."""
        cfg = self.config
        started_ns = time.time_ns() if self.tracer is not None else 0
        # a ``model`` naming an adapter: its base model, with that adapter (docs/lora.md)
        target = self.models.resolve(g.model)
        if target is None:
            raise ProtocolError(f"model {(g.model or '')[:80]!r} is not served here; this edge serves "
                                f"{', '.join(map(repr, self.models.bases))}", "model", g.id)
        model, lora = target.model, target.lora
        encoder = await self.encoder_for(model)
        bias = g.sampling.logit_bias
        if bias and max(t for t, _ in bias) >= len(encoder.tokenizer):
            raise ProtocolError(f"logit_bias token ids must be below the vocabulary size {len(encoder.tokenizer)}",
                                "logit_bias", g.id)
        tier = self.models.shedders[model].place(principal.tier if g.tier is None else max(principal.tier, g.tier),
                                  time.monotonic(), demote=cfg.slo_demote)
        if not isinstance(tier, int):
            raise ProtocolError(tier.reason, None, g.id, code=ErrorCode.OVERLOADED, retry_after=tier.retry_after)
        if g.sampling.guided:  # a constraint the grammar engine cannot compile never reaches the bus
            if self._grammars is None or self._grammars.tokenizer is not encoder.tokenizer:
                self._grammars = GrammarChecker(encoder.tokenizer, self.config.grammar_compile_timeout_s)
            problem = await self._grammars.check(g.sampling)
            if problem is not None:
                raise ProtocolError(f"cannot compile the output constraint: {problem}", problem.split(":", 1)[0], g.id)
        size = len(g.prompt) if g.prompt is not None else sum(len(m.content) for m in g.messages or ())
        if size > THREAD_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(encoder.encode, g)
        else:
            ids = encoder.encode(g)
        if gone():
            return None
        if g.max_tokens_given and len(ids) + g.sampling.max_tokens > encoder.context_len:
            # OpenAI's and vLLM's answer: a limit the context cannot hold is the client's error, not
            # something to clamp silently (issue #38); only the default limit is clamped below
            raise ProtocolError(f"max_tokens (or max_completion_tokens) {g.sampling.max_tokens} + the prompt's "
                                f"{len(ids)} tokens exceed the model's context length {encoder.context_len}; "
                                f"at most {encoder.context_len - len(ids)} new tokens fit", "max_tokens", g.id)
        max_tokens = min(g.sampling.max_tokens, encoder.context_len - len(ids))
        sampling = g.sampling if max_tokens == g.sampling.max_tokens else replace(g.sampling, max_tokens=max_tokens)
        sampling = sampling.seeded()  # told to the client: the accepted frame, OpenAI's ``seed`` field
        limited = self.limiter.admit(principal.entry, len(ids) + max_tokens, time.monotonic())
        if limited is not None:
            raise ProtocolError(limited.message, limited.field, g.id,
                                code=ErrorCode.OVERLOADED if limited.overloaded else ErrorCode.RATE_LIMITED,
                                retry_after=limited.retry_after)
        now = asyncio.get_running_loop().time()
        rid = self.new_request_id()
        labels = (model, f"p{tier}", api)
        s = Stream(rid, client_id if client_id is not None else g.id, sink, principal, labels, len(ids), max_tokens,
                   now, now + cfg.request_timeout_s, token_ids)
        if self.tracer is not None:
            # From the admission's start: tokenization is part of the request's time at the edge.
            # Requests refused above get no span (the rejection metrics count them).
            s.span = self.tracer.start("lockgate.request", trace_parent, SpanKind.SERVER, started_ns, {
                "lockgate.request_id": rid, "lockgate.api": api, "lockgate.tier": tier,
                "lockgate.tenant": principal.tenant, "gen_ai.request.model": model,
                "gen_ai.usage.input_tokens": len(ids), "gen_ai.request.max_tokens": max_tokens})
        self.lifecycle.register(s, owner)
        self.metrics.prompt_tokens.labels(*labels).inc(len(ids))
        wall = time.time()
        req = InferenceRequest(
            request_id=rid, model=model, prompt_token_ids=tuple(ids), sampling=sampling,
            reply_to=self.reply_topic, tenant=principal.tenant, tier=tier, enqueued_at=wall,
            deadline=wall + cfg.request_timeout_s, prompt_text=g.prompt, messages=g.messages,
            # One prefix-cache namespace per tenant: a tenant never hits (and ``cached_tokens`` never
            # reveals) a prefix that another tenant sent.
            cache_salt=f"tenant:{principal.tenant}" + (f"|{g.cache_salt}" if g.cache_salt else ""),
            weight=principal.entry.weight, lora=lora, lora_path=target.lora_path)
        return Admitted(s, req)

    def adapters(self, model: str | None = None) -> list[str]:
        """The LoRA adapters of base ``model`` (default: the edge's own) a request's ``model`` may
        name (docs/lora.md; :meth:`ModelCatalog.adapters`)."""
        return self.models.adapters(model)

    def serves(self, name: str) -> bool:
        """Whether a request's ``model`` may be ``name``: a base model of this edge or an adapter of one."""
        return self.models.resolve(name) is not None

    async def encoder_for(self, model: str | None) -> PromptEncoder:
        """The tokenizer of the base model that ``model`` (a base model or an adapter; None: the
        edge's own) runs on, loaded on first use. Raises :class:`ProtocolError` (404) for a name
        this edge does not serve."""
        target = self.models.resolve(model)
        if target is None:
            raise ProtocolError(f"the model {(model or '')[:200]!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.models.bases))}", "model", code="model_not_found")
        return await self.models.encoder_for(target.model)

    def trace_parent(self, headers: Mapping[str, str]) -> SpanContext | None:
        """The client's context from its HTTP (or WebSocket upgrade) request's ``traceparent``
        header (and its ``tracestate``, passed on unchanged); None when tracing is off (the header is not even read) or the header is absent or
        malformed (a new trace starts; the request itself is never refused for it)."""
        if self.tracer is None:
            return None
        return parse_headers(headers.get(HEADER), headers.get(STATE_HEADER))

    async def publish(self, a: Admitted) -> bool:
        """Publish an admitted request on its tier's topic, waiting at most ``publish_timeout_s``.
        ``True`` once the bus acknowledged the write. Otherwise the stream fails with an
        ``overloaded`` error (HTTP 503, ``retry_after`` 1 s) naming the bus, as if a worker had sent
        it, and a Cancel is queued: a write that timed out here may still land when the bus
        returns, and the worker then drops it instead of running a request nobody waits for."""
        req, span = a.request, a.stream.span
        timeout = self.config.publish_timeout_s
        headers: tuple[tuple[str, bytes], ...] = ()
        pub = None
        if span is not None and self.tracer is not None:
            # The record carries the publish span's context: the worker's span is its child, so
            # the trace reads edge request -> publish -> worker (docs/observability.md).
            pub = self.tracer.start("lockgate.publish", span, SpanKind.PRODUCER)
            headers = to_headers(pub.context)
        with bound(req.request_id, span.context.trace_id if span is not None else None):
            # the bus's and placement's log lines name the request (JSON logs)
            try:
                topic = self.config.layout.request_topic(req.model, req.tier)
                if pub is not None:
                    pub.set("messaging.destination.name", topic)
                async with asyncio.timeout(timeout):
                    key, partition = await self.placement.place(topic, req)
                    await self.bus.send(topic, encode(req), key=key, headers=headers, partition=partition)
            except asyncio.CancelledError:
                # the handler went away mid-send (client gone, shutdown): the write may still
                # land, so a worker is told to drop it; the span ends rather than leaking
                if pub is not None:
                    pub.fail("publish cancelled")
                    pub.end()
                self.publish_cancel(req.request_id, "unqueued")
                raise
            except Exception as exc:
                # A programming or configuration error (a tier the layout refuses, a record that
                # does not encode) is ours, not an outage: 500 `internal`, never a retryable 503.
                ours = isinstance(exc, (TypeError, ValueError, LookupError, AttributeError, AssertionError)) \
                    and not isinstance(exc, BusError)
                why = f"no answer within {timeout:g} s (publish_timeout_s)" if isinstance(exc, TimeoutError) else str(exc)
                if ours:
                    log.exception("publishing %s failed", req.request_id)
                else:
                    log.warning("publishing %s failed: %s", req.request_id, why)
                if pub is not None:
                    pub.fail(f"publish failed: {why}"[:300])
                    pub.end()
                trace = f"{'internal' if ours else 'overloaded'}: the request was not queued: {why}"[:300]
                if ours:
                    self.lifecycle.fail(a.stream, ErrorCode.INTERNAL, f"the request was not queued: {why}"[:300],
                                        why=trace)
                else:
                    self.lifecycle.fail(a.stream, ErrorCode.OVERLOADED,
                                        f"the bus is unreachable, the request was not queued: {why}"[:300], 1.0,
                                        why=trace)
                self.publish_cancel(req.request_id, "unqueued")
                return False
            if pub is not None:
                pub.end()
            return True

    # --- cancels ------------------------------------------------------------------------------
    def open_outbox(self) -> None:
        self._cancels = asyncio.Queue(CANCEL_OUTBOX)

    def outbox_empty(self) -> bool:
        return self._cancels is None or self._cancels.empty()

    def publish_cancel(self, request_id: str, reason: str) -> None:
        """Queue a Cancel for the control topic (non-blocking; dropped with a warning if the outbox
        is full — the worker then finishes the request and the edge drops its replies)."""
        self.metrics.cancels.labels(reason).inc()
        if self._cancels is None:
            return
        try:
            self._cancels.put_nowait(Cancel(request_id, reason))
        except asyncio.QueueFull:
            log.warning("cancel outbox full: dropping Cancel(%s)", request_id)

    async def run_cancels(self) -> None:
        """The outbox's publisher task (owned by the edge)."""
        assert self._cancels is not None
        topic = self.config.layout.control_topic
        while True:
            c = await self._cancels.get()
            try:  # bounded like a request's publish: a broker outage must not stall the outbox
                async with asyncio.timeout(self.config.publish_timeout_s):
                    await self.bus.send(topic, encode(c), key=c.request_id.encode())
            except Exception as exc:  # keep going: a lost Cancel only wastes worker time
                log.warning("publishing Cancel(%s) failed: %s", c.request_id, exc)
