"""``--otlp-endpoint`` / ``--service-name`` (lockgate/telemetry.py): env twins, checking, and the
process tracer they build (none when no endpoint is set)."""

from __future__ import annotations

import argparse

import pytest

from lockgate.cli import build_parser
from lockgate.telemetry import add_tracing_flags, tracer_for
from tests.tracing.receiver import receiving
from tests.waiting import wait_until
from tracing import SpanContext

ENV = ("LOCKGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "LOCKGATE_SERVICE_NAME", "OTEL_SERVICE_NAME")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tracing_flags(p)
    return p.parse_args(argv)


def test_off_by_default_and_the_global_flags_exist() -> None:
    a = parse([])
    assert (a.otlp_endpoint, a.service_name) == ("", "")
    g = build_parser().parse_args(["--otlp-endpoint", "http://127.0.0.1:4318", "--service-name", "gw", "edge"])
    assert (g.otlp_endpoint, g.service_name) == ("http://127.0.0.1:4318", "gw")


def test_env_twins_then_the_standard_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "std")
    assert (parse([]).otlp_endpoint, parse([]).service_name) == ("http://otel:4318", "std")
    monkeypatch.setenv("LOCKGATE_OTLP_ENDPOINT", "http://ours:4318")
    monkeypatch.setenv("LOCKGATE_SERVICE_NAME", "ours")
    assert (parse([]).otlp_endpoint, parse([]).service_name) == ("http://ours:4318", "ours")
    assert parse(["--otlp-endpoint", "http://flag:4318"]).otlp_endpoint == "http://flag:4318"  # the flag wins


def test_a_bad_endpoint_is_refused_when_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--otlp-endpoint", "127.0.0.1:4318"])
    err = capsys.readouterr().err
    assert "--otlp-endpoint" in err and "'127.0.0.1:4318' is not an http:// or https:// URL" in err


def test_trace_sample_ratio_flag_env_twins_and_range(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert parse([]).trace_sample_ratio == 1.0
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    assert parse([]).trace_sample_ratio == 1.0  # the argument of some other sampler: not a ratio
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    assert parse([]).trace_sample_ratio == 0.5
    monkeypatch.setenv("LOCKGATE_TRACE_SAMPLE_RATIO", "0.25")
    assert parse([]).trace_sample_ratio == 0.25
    assert parse(["--trace-sample-ratio", "0"]).trace_sample_ratio == 0.0  # the flag wins
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            parse(["--trace-sample-ratio", bad])
        err = capsys.readouterr().err
        assert "--trace-sample-ratio" in err and repr(bad) in err


async def test_the_process_tracer_takes_the_ratio() -> None:
    with receiving() as rcv:
        async with tracer_for(parse(["--otlp-endpoint", rcv.url, "--trace-sample-ratio", "0"]), "edge") as tracer:
            assert tracer is not None and tracer.sample_ratio == 0.0
            tracer.start("dropped").end()  # a new root at ratio 0: not exported
            tracer.start("kept", SpanContext(TRACE, "00f067aa0ba902b7", True)).end()  # a sampled parent decides
        await wait_until(lambda: len(rcv.spans()) == 1, timeout=10)
        assert [s.name for s in rcv.spans()] == ["kept"]


async def test_no_endpoint_no_tracer() -> None:
    async with tracer_for(parse([]), "edge") as tracer:
        assert tracer is None


async def test_the_tracer_exports_under_the_service_name() -> None:
    with receiving() as rcv:
        async with tracer_for(parse(["--otlp-endpoint", rcv.url]), "worker") as tracer:
            assert tracer is not None
            tracer.start("one").end()
        # leaving the context stopped the exporter, which flushed
        await wait_until(lambda: len(rcv.spans()) == 1, timeout=10)
        (s,) = rcv.spans()
        assert s.service == "lockgate-worker" and s.name == "one" and rcv.errors == []
        assert s.resource["service.instance.id"]
        async with tracer_for(parse(["--otlp-endpoint", rcv.url, "--service-name", "gw-1"]), "edge") as tracer:
            assert tracer is not None
            tracer.start("two").end()
        await wait_until(lambda: len(rcv.spans()) == 2, timeout=10)
        assert rcv.spans()[1].service == "gw-1"


async def test_lockgate_serve_traces_edge_and_worker_under_one_service(tiny_model_dir: str) -> None:
    """`lockgate serve --otlp-endpoint`: the embedded edge and worker share one exporter
    (`lockgate-serve`), and one request is one trace from the client's header to the reply send;
    stopping the platform flushes the spans."""
    import asyncio
    import json

    import websockets

    from lockgate.serve import run_embedded
    from tests.lockgate.test_serve import serve_args

    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with receiving() as rcv:
        args = serve_args(tiny_model_dir)
        args.otlp_endpoint, args.service_name = rcv.url, ""  # the global flags, as `lockgate --otlp-endpoint URL serve`
        ready, stop = asyncio.get_running_loop().create_future(), asyncio.Event()
        task = asyncio.create_task(run_embedded(args, ready, stop, freeze=False))
        try:
            port = await asyncio.wait_for(ready, 60)
            async with websockets.connect(f"ws://127.0.0.1:{port}/ws",
                                          additional_headers={"traceparent": f"00-{trace}-{parent}-01"}) as ws:
                await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "hi", "max_tokens": 4, "temperature": 0}))
                for _ in range(100):
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if msg["type"] in ("done", "error"):
                        break
            assert msg["type"] == "done", msg
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 60) == 0
        spans = [s for s in rcv.spans() if s.trace_id == trace]
        names = {s.name for s in spans}
        assert {"lockgate.request", "lockgate.publish", "lockgate.worker", "queue wait", "prefill", "reply send"} <= names
        assert {s.service for s in spans} == {"lockgate-serve"} and rcv.errors == []
        by = {s.name: s for s in spans}
        assert by["lockgate.request"].parent_id == parent
        assert by["lockgate.worker"].parent_id == by["lockgate.publish"].span_id


async def test_the_exporter_counters_are_prometheus_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from lockgate.telemetry import expose_metrics
    from tests.tracing.receiver import dead_endpoint

    off = CollectorRegistry()
    expose_metrics(None, off)  # tracing off: nothing registered
    assert b"trace_spans" not in generate_latest(off)

    def value(registry: CollectorRegistry, name: str) -> float:
        v = registry.get_sample_value(name)
        assert v is not None, name
        return v

    with receiving() as rcv:
        reg = CollectorRegistry()
        async with tracer_for(parse(["--otlp-endpoint", rcv.url]), "edge") as tracer:
            expose_metrics(tracer, reg)
            assert tracer is not None
            for _ in range(3):
                tracer.start("s").end()
        assert value(reg, "lockgate:trace_spans_exported_total") == 3
        assert value(reg, "lockgate:trace_spans_dropped_total") == 0
    reg = CollectorRegistry()
    async with tracer_for(parse(["--otlp-endpoint", dead_endpoint()]), "edge") as tracer:
        expose_metrics(tracer, reg)
        assert tracer is not None
        tracer.start("s").end()
    assert value(reg, "lockgate:trace_spans_dropped_total") == 1
    assert value(reg, "lockgate:trace_export_failures_total") == 1
    assert value(reg, "lockgate:trace_spans_exported_total") == 0
