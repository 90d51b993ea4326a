"""One trace across processes' roles: client ``traceparent`` -> edge span -> publish span -> the
Kafka request record's headers -> worker span -> its phases (queue wait, prefill, decode, reply
send). Real Kafka, a real worker (tiny random model), both exporting over OTLP/HTTP to the test's
receiver (tests/tracing/receiver.py, which parses every body with the official protobuf
definitions). Also: with the collector dead, requests are served as before."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from websockets.asyncio.client import connect as ws_connect

from bus import connect
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.edge.conftest import collect, send
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixtures, used by name
from tests.tracing.receiver import GotSpan, Receiver, dead_endpoint, receiving
from tests.waiting import wait_until
from tracing import OtlpExporter, SpanKind, Tracer

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Tell me about Kafka topics."}]
PHASES = ("queue wait", "prefill", "decode", "reply send")
MAX_TOKENS = 8
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"  # a vendor's tracestate (the W3C spec's example members)


@contextlib.asynccontextmanager
async def traced_platform(bus_url: str, model_dir: Path, endpoint: str) -> AsyncIterator[tuple]:
    """Edge and worker on one bus, each with its own exporter and service name (as two processes
    would be), flushing every 50 ms."""
    layout = new_layout(2)
    encoder = PromptEncoder.from_path(str(model_dir))
    edge_ex = OtlpExporter(endpoint, {"service.name": "lockgate-edge"}, interval_s=0.05, timeout_s=2)
    worker_ex = OtlpExporter(endpoint, {"service.name": "lockgate-worker"}, interval_s=0.05, timeout_s=2)
    async with edge_ex, worker_ex, connect(bus_url) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, make_engine(model_dir),
                          tracer=Tracer(worker_ex.offer)), \
                Edge(EdgeConfig(model=MODEL, port=0, openai_port=0, layout=layout, ping_interval_s=None),
                     bus, encoder, tracer=Tracer(edge_ex.offer)) as edge:
            await wait_until(lambda: edge.readiness()[0], timeout=30)
            yield edge, edge_ex, worker_ex


async def chat(edge: Edge, headers: dict[str, str]) -> dict:
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{edge.openai_port}/v1/chat/completions", headers=headers,
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "ignore_eos": True}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def trace_of(rcv: Receiver, trace_id: str) -> list[GotSpan]:
    return [s for s in rcv.spans() if s.trace_id == trace_id]


def complete(spans: list[GotSpan]) -> bool:
    return {"lockgate.request", "lockgate.publish", "lockgate.worker", *PHASES} <= {s.name for s in spans}


def check_trace(spans: list[GotSpan], client_parent: str, api: str, prompt_tokens: int, state: str = "") -> None:
    """One request's spans: the chain client -> edge -> publish -> worker -> phases, services, kinds,
    attributes and times; every span carries the client's tracestate ``state`` unchanged."""
    assert len({s.span_id for s in spans}) == len(spans)
    assert {s.trace_state for s in spans} == {state}, [(s.name, s.trace_state) for s in spans]
    by = {s.name: s for s in spans}
    assert sorted(s.name for s in spans) == sorted(by), [s.name for s in spans]  # each once
    req, pub, wrk = by["lockgate.request"], by["lockgate.publish"], by["lockgate.worker"]
    assert (req.parent_id, req.kind, req.service) == (client_parent, SpanKind.SERVER, "lockgate-edge")
    assert (pub.parent_id, pub.kind, pub.service) == (req.span_id, SpanKind.PRODUCER, "lockgate-edge")
    assert (wrk.parent_id, wrk.kind, wrk.service) == (pub.span_id, SpanKind.CONSUMER, "lockgate-worker")
    for name in PHASES:
        p = by[name]
        assert (p.parent_id, p.kind, p.service) == (wrk.span_id, SpanKind.INTERNAL, "lockgate-worker"), name
    for s in spans:
        assert 0 < s.start_ns <= s.end_ns, s
        assert s.status_code == 0, s  # none failed
    # the phases tile the worker span in order: queue wait, prefill, decode, then the reply's send
    qw, pf, dc, rs = (by[n] for n in PHASES)
    assert qw.start_ns == wrk.start_ns and qw.end_ns == pf.start_ns and pf.end_ns == dc.start_ns
    assert dc.end_ns <= rs.start_ns and rs.end_ns == wrk.end_ns
    assert pub.start_ns >= req.start_ns and pub.end_ns <= wrk.end_ns
    rid = req.attributes["lockgate.request_id"]
    assert wrk.attributes["lockgate.request_id"] == rid
    assert req.attributes["lockgate.api"] == api and req.attributes["gen_ai.request.model"] == MODEL
    assert req.attributes["gen_ai.usage.input_tokens"] == prompt_tokens == wrk.attributes["gen_ai.usage.input_tokens"]
    assert req.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS == wrk.attributes["gen_ai.usage.output_tokens"]
    assert req.attributes["gen_ai.response.finish_reasons"] == "length" == wrk.attributes["gen_ai.response.finish_reasons"]
    assert pf.attributes["gen_ai.usage.input_tokens"] == prompt_tokens and dc.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert wrk.attributes["messaging.destination.name"] == pub.attributes["messaging.destination.name"]
    assert wrk.attributes["messaging.kafka.offset"] >= 0 and wrk.attributes["lockgate.worker_id"]


@pytest.mark.kafka
async def test_one_trace_spans_edge_kafka_and_worker(kafka_bootstrap: str, tiny_dir: Path) -> None:
    http_trace, ws_trace = os.urandom(16).hex(), os.urandom(16).hex()
    http_parent, ws_parent = os.urandom(8).hex(), os.urandom(8).hex()
    with receiving() as rcv:
        async with traced_platform(kafka_url(kafka_bootstrap), tiny_dir, rcv.url) as (edge, edge_ex, worker_ex):
            # first, a client that does not sample its trace (flags 00): served, and none of its
            # spans are exported (they would be queued before the next requests' spans)
            unsampled = os.urandom(16).hex()
            r = await chat(edge, {"traceparent": f"00-{unsampled}-{http_parent}-00"})
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
            # OpenAI HTTP: the request's own traceparent header, and a vendor's tracestate that
            # every span of the trace carries on (over the Kafka record's headers to the worker)
            r = await chat(edge, {"traceparent": f"00-{http_trace}-{http_parent}-01", "tracestate": STATE})
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
            prompt_tokens = r["usage"]["prompt_tokens"]
            # WebSocket: the upgrade request's header, for every request on the connection
            async with ws_connect(f"ws://127.0.0.1:{edge.port}/ws",
                                  additional_headers={"traceparent": f"00-{ws_trace}-{ws_parent}-01"}) as ws:
                await send(ws, {"type": "generate", "id": "a", "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "ignore_eos": True})
                _, _, done = await collect(ws, "a", timeout=60)
            assert done["type"] == "done" and done["usage"]["completion_tokens"] == MAX_TOKENS, done
            # a malformed header (all-zero trace id) is ignored: served, and traced as a new trace
            bad = await chat(edge, {"traceparent": f"00-{'0' * 32}-{http_parent}-01"})
            assert bad["usage"]["completion_tokens"] == MAX_TOKENS

            await wait_until(lambda: complete(trace_of(rcv, http_trace)) and complete(trace_of(rcv, ws_trace)),
                             timeout=30, message=lambda: f"spans so far: {[(s.trace_id, s.name) for s in rcv.spans()]}")
            check_trace(trace_of(rcv, http_trace), http_parent, "openai", prompt_tokens, STATE)
            check_trace(trace_of(rcv, ws_trace), ws_parent, "ws", prompt_tokens)

            def fresh() -> list[GotSpan]:
                roots = [s for s in rcv.spans() if s.name == "lockgate.request" and s.parent_id == ""]
                return trace_of(rcv, roots[0].trace_id) if roots else []

            await wait_until(lambda: complete(fresh()), timeout=30)
            check_trace(fresh(), "", "openai", prompt_tokens)
            assert fresh()[0].trace_id not in (http_trace, ws_trace, "0" * 32)
            assert trace_of(rcv, unsampled) == []
        assert rcv.errors == []  # every body was a valid ExportTraceServiceRequest
        assert edge_ex.dropped == 0 and worker_ex.dropped == 0


async def test_a_dead_collector_does_not_break_serving(tiny_dir: Path) -> None:
    """Tracing on, the collector unreachable: the request is served, its spans are counted as
    dropped, nothing raises (the in-memory bus: this is about the exporter, not Kafka)."""
    async with traced_platform("memory://", tiny_dir, dead_endpoint()) as (edge, edge_ex, worker_ex):
        r = await chat(edge, {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"})
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        await wait_until(lambda: edge_ex.failed_batches >= 1 and worker_ex.failed_batches >= 1, timeout=30)
        r = await chat(edge, {})  # and the next one too
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert edge_ex.exported == worker_ex.exported == 0
    assert edge_ex.dropped >= 2 and worker_ex.dropped >= 5  # edge: request + publish; worker: span + 4 phases
