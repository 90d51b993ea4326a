"""Topic names and the default topic layout. Pure.

Layout (``<ns>`` defaults to ``lockgate``, ``<model>`` is the model name made topic-safe):

* ``<ns>.req.<model>.p0|p1|p2`` — priority topics, the durable request log, keyed by request id
  (the edge: by tenant + prompt prefix, on a partition it picks; edge/admission/affinity.py).
* ``<ns>.reply.<owner>``        — a reply topic: one per edge instance, per batch job, or per request.
* ``<ns>.control``              — broadcast control (``Cancel``); every worker reads all of it.
* ``<ns>.status``               — worker heartbeats (``WorkerStatus``).
* ``<ns>.dlq``                  — dead letters: records that could not be decoded, with the reason.
* ``<ns>.usage``                — the billing log: one ``UsageRecord`` per finished request, keyed by tenant.
* ``<ns>.table.<name>``         — a compacted key/value table shared by the fleet (:mod:`bus.table`),
  e.g. ``<ns>.table.responses``: the edges' stored responses and resume positions.
* ``<ns>.edges``                — edge heartbeats (``EdgeStatus``): each key's load per edge, for fleet-wide limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.base import TopicSpec, safe_name, validate_topic
from bus.messages import Tier

__all__ = ["TopicLayout", "safe_name", "validate_topic"]

EDGES_RETENTION_MS = 600_000  # edge heartbeats matter for seconds; ten minutes keeps a short history to read


@dataclass(frozen=True, slots=True)
class TopicLayout:
    namespace: str = "lockgate"
    partitions: int = 6
    replication: int = 1
    retention_ms: int = 7 * 24 * 3600 * 1000  # a week of replayable request log
    reply_retention_ms: int = 3600 * 1000

    def request_topic(self, model: str, tier: int) -> str:
        if tier not in tuple(Tier):
            raise ValueError(f"tier must be one of {[int(t) for t in Tier]}, got {tier}")
        return f"{self.namespace}.req.{safe_name(model)}.p{int(tier)}"

    def request_topics(self, model: str) -> list[str]:
        return [self.request_topic(model, t) for t in Tier]

    def reply_topic(self, owner: str) -> str:
        return f"{self.namespace}.reply.{safe_name(owner)}"

    @property
    def control_topic(self) -> str:
        return f"{self.namespace}.control"

    @property
    def status_topic(self) -> str:
        return f"{self.namespace}.status"

    @property
    def dead_letter_topic(self) -> str:
        return f"{self.namespace}.dlq"

    @property
    def usage_topic(self) -> str:
        return f"{self.namespace}.usage"

    @property
    def edges_topic(self) -> str:
        return f"{self.namespace}.edges"

    def edges_spec(self) -> TopicSpec:
        """One partition: every edge reads the heartbeats in one order, so an edge that reads its
        own heartbeat back has read every heartbeat written before it (edge/admission/fleet.py)."""
        return TopicSpec(self.edges_topic, 1, self.replication, EDGES_RETENTION_MS)

    def model_specs(self, model: str) -> list[TopicSpec]:
        """Everything one model needs: its priority topics plus the shared control/status/dlq/usage."""
        reqs = [TopicSpec(t, self.partitions, self.replication, self.retention_ms) for t in self.request_topics(model)]
        shared = [
            TopicSpec(self.control_topic, 1, self.replication, self.reply_retention_ms),
            TopicSpec(self.status_topic, 1, self.replication, self.reply_retention_ms),
            TopicSpec(self.dead_letter_topic, 1, self.replication, self.retention_ms),
            TopicSpec(self.usage_topic, 1, self.replication, self.retention_ms),
        ]
        return reqs + shared

    def table_topic(self, name: str) -> str:
        return f"{self.namespace}.table.{safe_name(name)}"

    def table_spec(self, name: str, retention_ms: int, partitions: int | None = None) -> TopicSpec:
        """A compacted table's topic (:class:`bus.table.CompactedTable`)."""
        return TopicSpec(self.table_topic(name), partitions or self.partitions, self.replication, retention_ms,
                         compact=True)

    def reply_spec(self, owner: str, partitions: int | None = None) -> TopicSpec:
        return TopicSpec(self.reply_topic(owner), partitions or self.partitions, self.replication, self.reply_retention_ms)
