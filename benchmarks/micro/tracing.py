"""What tracing costs per request on the CPU, next to a cost every request pays anyway (encoding
its request record for the bus), run back to back (docs/observability.md, "Tracing").

    .venv/bin/python -m benchmarks.micro.tracing [--n 20000] [--repeat 5] [--prompt-tokens 512]

Prints the best-of-``repeat`` microseconds per call of: the edge's spans of one request (the
``lockgate.request`` and ``lockgate.publish`` spans with their attributes, the record header
written and read back), the worker's (``lockgate.worker`` and its four phases), OTLP JSON encoding
per span (a 512-span batch, as the exporter sends), and the peer: ``bus.encode`` of one request
record of ``--prompt-tokens`` tokens. The spans go to a list, not the exporter: no I/O is timed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bus import InferenceRequest, SamplingParams, encode
from tracing import SpanKind, SpanRecord, Tracer, from_headers, parse_traceparent, to_headers
from tracing import encode as otlp_encode


def best_us(f: Callable[[], object], n: int, repeat: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timed run")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs; the best is printed")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of the peer's request record")
    a = ap.parse_args()

    sink: list[SpanRecord] = []
    tracer = Tracer(sink.append)
    client = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")

    def edge() -> None:
        s = tracer.start("lockgate.request", client, SpanKind.SERVER, None, {
            "lockgate.request_id": "edge-1-2-3", "lockgate.api": "ws", "lockgate.tier": 1, "lockgate.tenant": "acme",
            "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": a.prompt_tokens, "gen_ai.request.max_tokens": 256})
        p = tracer.start("lockgate.publish", s, SpanKind.PRODUCER)
        headers = to_headers(p.context)
        p.set("messaging.destination.name", "lockgate.req.m.p1")
        p.end()
        s.set("gen_ai.usage.output_tokens", 256)
        s.set("gen_ai.response.finish_reasons", "length")
        s.end()
        from_headers(headers)  # what the worker then reads back
        sink.clear()

    def worker() -> None:
        w = tracer.start("lockgate.worker", client, SpanKind.CONSUMER, attributes={
            "lockgate.request_id": "edge-1-2-3", "lockgate.worker_id": "w-1", "lockgate.tier": 1, "lockgate.attempt": 0,
            "messaging.destination.name": "lockgate.req.m.p1", "messaging.destination.partition.id": "3",
            "messaging.kafka.offset": 12345, "gen_ai.request.model": "m"})
        t = w.start_ns
        tracer.record("queue wait", w, t, t + 1)
        tracer.record("prefill", w, t + 1, t + 2, attributes={"gen_ai.usage.input_tokens": 512, "lockgate.cached_tokens": 0})
        tracer.record("decode", w, t + 2, t + 3, attributes={"gen_ai.usage.output_tokens": 256})
        tracer.record("reply send", w, t + 3, t + 4)
        w.set("gen_ai.usage.input_tokens", 512)
        w.set("gen_ai.usage.output_tokens", 256)
        w.end()
        sink.clear()

    # a batch as the exporter sends it: one request's seven spans, repeated
    edge_batch: list[SpanRecord] = []
    tracer.sink = edge_batch.append
    while len(edge_batch) < 512:
        s = tracer.start("lockgate.request", client, SpanKind.SERVER, None, {"lockgate.request_id": "r", "lockgate.tier": 1})
        tracer.record("prefill", s, 1, 2, attributes={"gen_ai.usage.input_tokens": 512})
        s.end()
    tracer.sink = sink.append
    batch = edge_batch[:512]
    req = InferenceRequest("edge-1-2-3", "m", tuple(range(a.prompt_tokens)), SamplingParams(max_tokens=256), "reply.e")

    peer = best_us(lambda: encode(req), a.n, a.repeat)
    rows = [("edge spans of one request (2 spans + header)", best_us(edge, a.n, a.repeat)),
            ("worker spans of one request (5 spans)", best_us(worker, a.n, a.repeat)),
            ("OTLP JSON encoding, per span (512-span batch)",
             best_us(lambda: otlp_encode(batch, {"service.name": "x"}), max(1, a.n // 200), a.repeat) / 512),
            (f"peer: bus.encode of one {a.prompt_tokens}-token request record", peer)]
    for name, us in rows:
        print(f"{name:52s} {us:8.2f} us   {us / peer:6.2f}x the peer")


if __name__ == "__main__":
    main()
