"""The span recorder: ids, parent links, attributes, one record per span."""

from __future__ import annotations

import os

import pytest

from tracing import SpanContext, SpanKind, SpanRecord, Tracer, parse_traceparent, ratio_sampled


def recorder() -> tuple[Tracer, list[SpanRecord]]:
    got: list[SpanRecord] = []
    return Tracer(got.append), got


def test_a_root_span_is_recorded_once_when_it_ends() -> None:
    tracer, got = recorder()
    s = tracer.start("root", kind=SpanKind.SERVER, start_ns=1_000, attributes={"a": 1, "gone": None})
    assert got == []  # nothing until it ends
    s.end(5_000)
    s.end(9_000)  # a second end is ignored
    (r,) = got
    assert (r.name, r.kind, r.start_ns, r.end_ns, r.parent_id, r.error) == ("root", SpanKind.SERVER, 1_000, 5_000, "", None)
    assert r.trace_id == s.context.trace_id and r.span_id == s.context.span_id
    assert len(r.trace_id) == 32 and len(r.span_id) == 16 and parse_traceparent(s.context.traceparent()) == s.context
    assert r.attributes == (("a", 1),)  # a None attribute is not recorded


def test_children_share_the_trace_and_name_their_parent() -> None:
    tracer, got = recorder()
    root = tracer.start("root")
    child = tracer.start("child", root)
    grandchild = tracer.start("grandchild", child.context)  # a context, as read from a header
    for s in (grandchild, child, root):
        s.end()
    by = {r.name: r for r in got}
    assert {r.trace_id for r in got} == {root.context.trace_id}
    assert by["child"].parent_id == by["root"].span_id and by["grandchild"].parent_id == by["child"].span_id
    assert len({r.span_id for r in got}) == 3


def test_a_remote_parent_keeps_its_trace_and_sampled_flag() -> None:
    tracer, got = recorder()
    remote = SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    s = tracer.start("edge", remote)
    assert s.context.trace_id == remote.trace_id and s.context.sampled is True
    assert s.context.span_id != remote.span_id
    s.end()
    assert got[0].parent_id == remote.span_id and got[0].trace_id == remote.trace_id


def test_an_unsampled_trace_records_nothing() -> None:
    """Parent-based sampling: the client's ``-00`` flags carry down the chain (the publish span's
    header too), and no span of that trace is exported; a new root is always sampled."""
    tracer, got = recorder()
    remote = SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", sampled=False)
    edge = tracer.start("edge", remote)
    publish = tracer.start("publish", edge)
    assert publish.context.sampled is False and publish.context.traceparent().endswith("-00")
    worker = tracer.start("worker", parse_traceparent(publish.context.traceparent()))
    tracer.record("phase", worker, 1, 2)
    for s in (worker, publish, edge):
        s.end()
    assert got == []
    assert tracer.start("root").context.sampled is True


def test_separate_roots_are_separate_traces() -> None:
    tracer, _ = recorder()
    assert tracer.start("a").context.trace_id != tracer.start("b").context.trace_id


def test_attributes_and_failure() -> None:
    tracer, got = recorder()
    s = tracer.start("s", attributes={"x": "1"})
    s.set("n", 3)
    s.set("x", "2")  # overwrites
    s.set("none", None)  # ignored
    s.fail("e" * 1000)
    s.end()
    (r,) = got
    assert dict(r.attributes) == {"x": "2", "n": 3}
    assert r.error == "e" * 300  # bounded


def test_end_never_precedes_start_and_record_takes_known_times() -> None:
    tracer, got = recorder()
    tracer.start("s", start_ns=10_000).end(5_000)  # a clock step backwards: clamped
    parent = tracer.start("p")
    tracer.record("phase", parent, 20_000, 30_000, attributes={"k": 7, "skip": None})
    assert (got[0].start_ns, got[0].end_ns) == (10_000, 10_000)
    phase = got[1]
    assert (phase.start_ns, phase.end_ns, phase.parent_id, phase.kind) == (20_000, 30_000, parent.context.span_id,
                                                                           SpanKind.INTERNAL)
    assert phase.attributes == (("k", 7),)


def test_ratio_sampling_of_new_roots() -> None:
    ids = [os.urandom(16).hex() for _ in range(4000)]
    assert all(ratio_sampled(t, 1.0) for t in ids) and not any(ratio_sampled(t, 0.0) for t in ids)
    kept = [t for t in ids if ratio_sampled(t, 0.25)]
    assert 800 < len(kept) < 1200  # 1000 expected; binomial sd ~27
    assert all(ratio_sampled(t, 0.5) for t in kept)  # ratios nest: what 0.25 keeps, 0.5 keeps
    # the decision reads the id's low 64 bits (OpenTelemetry's TraceIdRatioBased)
    assert ratio_sampled("f" * 16 + "0" * 16, 0.01) and not ratio_sampled("0" * 16 + "f" * 16, 0.99)


def test_a_tracer_samples_roots_by_ratio_and_follows_parents() -> None:
    got: list[SpanRecord] = []
    tracer = Tracer(got.append, sample_ratio=0.0)
    root = tracer.start("root")
    assert root.context.sampled is False
    tracer.start("child", root).end()
    root.end()
    assert got == []  # the whole unsampled trace is dropped
    tracer.start("joined", SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", True)).end()
    assert [r.name for r in got] == ["joined"]  # a sampled parent decides for its trace
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="sample_ratio"):
            Tracer(got.append, sample_ratio=bad)
