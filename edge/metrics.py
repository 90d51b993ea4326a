"""Prometheus metrics of one edge. Each :class:`EdgeMetrics` owns its own ``CollectorRegistry``, so
several edges (tests, embedded servers) never collide. Names follow vLLM's where the meaning is the
same (``vllm:time_to_first_token_seconds`` -> ``lockgate:time_to_first_token_seconds``); latencies
here are measured at the edge, from admission to the frame being queued for the client.

Request-level series carry an ``api`` label: ``ws`` (the WebSocket protocol) or ``openai`` (the
OpenAI-compatible HTTP API); both go through the same admission (:mod:`edge.admission.gate`).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_ROUTE_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EdgeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[str, str, str], tuple] = {}
        self._generated: dict[tuple[str, str, str], int] = {}  # tokens not yet added to the counter
        ml = ["model", "tier", "api"]
        self.ttft = Histogram("lockgate:time_to_first_token_seconds",
                              "Edge-observed time from admission to the first output token.", ml,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lockgate:e2e_request_latency_seconds",
                             "Edge-observed time from admission to the end of the stream.", ml,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lockgate:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", ml,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.route = Histogram("lockgate:edge_routing_latency_seconds",
                               "Age of the oldest reply record of each routed batch when the batch is routed to sessions.",
                               buckets=_ROUTE_BUCKETS, registry=r)
        self.success = Counter("lockgate:request_success", "Finished requests by finish reason.",
                               ["model", "tier", "api", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("lockgate:prompt_tokens", "Prompt tokens admitted.", ml, registry=r)
        self.generation_tokens = Counter("lockgate:generation_tokens", "Output tokens sent to clients.", ml,
                                         registry=r)
        self.connections = Gauge("lockgate:edge_connections", "Open WebSocket connections.", registry=r)
        self.streams = Gauge("lockgate:edge_streams", "Requests in flight (accepted, not done).", registry=r)
        self.rejections = Counter("lockgate:edge_rejections", "Refused handshakes and requests by reason.",
                                  ["reason", "api"], registry=r)
        self.duplicates = Counter("lockgate:edge_duplicate_chunks", "Token chunks dropped as duplicates.",
                                  registry=r)
        self.fenced = Counter("lockgate:edge_fenced_replies",
                              "Replies dropped because a later attempt (a takeover) already replied.", registry=r)
        self.splice_mismatches = Counter(
            "lockgate:edge_splice_mismatches",
            "Streams ended because a re-run's tokens differed from those already sent.", registry=r)
        self.orphans = Counter("lockgate:edge_orphan_replies",
                               "Reply records for requests this edge no longer tracks.", registry=r)
        self.bad_records = Counter("lockgate:edge_undecodable_records", "Reply/status records not decodable.",
                                   registry=r)
        self.slow_disconnects = Counter("lockgate:edge_slow_client_disconnects",
                                        "Connections closed because the client read too slowly.", registry=r)
        self.cancels = Counter("lockgate:edge_cancels", "Cancel messages published, by reason.", ["reason"],
                               registry=r)
        self.live_workers = Gauge("lockgate:edge_live_workers", "Workers with a fresh heartbeat.", registry=r)
        self.live_edges = Gauge("lockgate:edge_live_edges",
                                "Edges sharing the keys' limits, this one included (fleet-wide limits).", registry=r)

    def per_request(self, labels: tuple[str, str, str]) -> tuple:
        """(ttft, e2e, tpot, generation_tokens) children for ``labels`` = (model, tier, api), cached:
        ``labels()`` is too slow to call once per token."""
        c = self._children.get(labels)
        if c is None:
            c = self._children[labels] = (self.ttft.labels(*labels), self.e2e.labels(*labels),
                                          self.tpot.labels(*labels), self.generation_tokens.labels(*labels))
        return c

    def add_generated(self, labels: tuple[str, str, str], n: int) -> None:
        """Count ``n`` output tokens for ``labels``; they reach the counter at the next
        :meth:`flush_generated` (the router calls it after each batch of records: one counter
        update per batch and label pair instead of one per token)."""
        self._generated[labels] = self._generated.get(labels, 0) + n

    def flush_generated(self) -> None:
        if self._generated:
            pending, self._generated = self._generated, {}
            for labels, n in pending.items():
                self.per_request(labels)[3].inc(n)

    def render(self) -> bytes:
        self.flush_generated()
        return generate_latest(self.registry)
