"""``--otlp-endpoint``: the process's tracer and its OTLP exporter, or None (tracing off).

The composition root's part of tracing (docs/observability.md, "Tracing"): the endpoint and the
service name come from the global flags, their ``LOCKGATE_*`` twins, then the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_SERVICE_NAME``; with no endpoint nothing is built.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from tracing import OtlpExporter, Tracer, traces_url


def otlp_endpoint_default() -> str:
    return os.environ.get("LOCKGATE_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def service_name_default() -> str:
    return os.environ.get("LOCKGATE_SERVICE_NAME") or os.environ.get("OTEL_SERVICE_NAME") or ""


# the standard samplers whose OTEL_TRACES_SAMPLER_ARG is a ratio (for the others it is not)
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


def sample_ratio_default() -> str:
    ours = os.environ.get("LOCKGATE_TRACE_SAMPLE_RATIO")
    if ours:
        return ours
    if os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() in RATIO_SAMPLERS:
        return os.environ.get("OTEL_TRACES_SAMPLER_ARG") or "1.0"
    return "1.0"


def sample_ratio(value: str) -> float:
    """``--trace-sample-ratio``'s type: a number within [0, 1] (the env twins' values too)."""
    try:
        ratio = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number within [0, 1], got {value!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value!r}")
    return ratio


def otlp_endpoint(value: str) -> str:
    """``--otlp-endpoint``'s type: "" (off) or an http(s) URL, checked when the flags are parsed
    (the env twins' values too: argparse runs a string default through its type)."""
    value = value.strip()
    if value:
        try:
            traces_url(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-endpoint", type=otlp_endpoint, default=otlp_endpoint_default(), metavar="URL",
                        help="export traces over OTLP/HTTP (JSON) to URL/v1/traces, e.g. http://127.0.0.1:4318; "
                             "empty: tracing off (env LOCKGATE_OTLP_ENDPOINT, then OTEL_EXPORTER_OTLP_ENDPOINT; "
                             "default: off)")
    parser.add_argument("--service-name", default=service_name_default(), metavar="NAME",
                        help="the traces' service.name (env LOCKGATE_SERVICE_NAME, then OTEL_SERVICE_NAME; "
                             "default: lockgate-<command>, e.g. lockgate-edge)")
    parser.add_argument("--trace-sample-ratio", type=sample_ratio, default=sample_ratio_default(), metavar="R",
                        help="share of new traces kept (by trace id, as OpenTelemetry's TraceIdRatioBased); a "
                             "client's traceparent decides for its own trace (env LOCKGATE_TRACE_SAMPLE_RATIO, "
                             "then OTEL_TRACES_SAMPLER_ARG with OTEL_TRACES_SAMPLER=[parentbased_]traceidratio; default: 1.0, every trace)")


class ProcessTracer(Tracer):
    """The process's tracer, knowing its exporter (for :func:`expose_metrics`)."""

    def __init__(self, exporter: OtlpExporter, sample_ratio: float = 1.0) -> None:
        super().__init__(exporter.offer, sample_ratio)
        self.exporter = exporter


class ExporterMetrics:
    """A prometheus-client collector of the exporter's counters, read at each scrape (so the
    exporter, in ``tracing/``, knows nothing of Prometheus)."""

    def __init__(self, exporter: OtlpExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        ex = self.exporter
        yield CounterMetricFamily("lockgate:trace_spans_exported", "Spans the OTLP receiver accepted.", value=ex.exported)
        yield CounterMetricFamily("lockgate:trace_spans_dropped",
                                  "Spans dropped: the export queue was full, or their batch failed.", value=ex.dropped)
        yield CounterMetricFamily("lockgate:trace_export_failures", "OTLP export POSTs that failed.",
                                  value=ex.failed_batches)


def expose_metrics(tracer: Tracer | None, registry: Any) -> None:
    """Show the exporter's counters on ``registry`` (the edge's or the worker's ``/metrics``); a
    no-op with tracing off."""
    if isinstance(tracer, ProcessTracer):
        registry.register(ExporterMetrics(tracer.exporter))


@asynccontextmanager
async def tracer_for(args: argparse.Namespace, command: str) -> AsyncIterator[Tracer | None]:
    """The tracer of a ``lockgate <command>`` process (its exporter started and, on exit, flushed
    and stopped), or None when no OTLP endpoint is configured. ``ValueError`` for a bad endpoint."""
    endpoint = str(getattr(args, "otlp_endpoint", "") or "")
    if not endpoint:
        yield None
        return
    name = str(getattr(args, "service_name", "") or "") or f"lockgate-{command}"
    exporter = OtlpExporter(endpoint, {"service.name": name,
                                       "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"})
    async with exporter:
        yield ProcessTracer(exporter, float(getattr(args, "trace_sample_ratio", 1.0)))
