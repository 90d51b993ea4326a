"""W3C ``traceparent``: what parses, what is ignored (the receiver then starts a new trace)."""

from __future__ import annotations

import pytest

from tracing import SpanContext, Tracer, from_headers, parse_headers, parse_traceparent, parse_tracestate, to_headers

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"


def test_the_spec_example_parses() -> None:
    assert parse_traceparent(GOOD) == SpanContext(TRACE, SPAN, True)
    assert parse_traceparent(GOOD.encode()) == SpanContext(TRACE, SPAN, True)
    assert parse_traceparent(f" {GOOD}\t") == SpanContext(TRACE, SPAN, True)  # optional whitespace around


@pytest.mark.parametrize("flags, sampled", [("00", False), ("01", True), ("02", False), ("03", True), ("ff", True)])
def test_sampled_is_the_low_flag_bit(flags: str, sampled: bool) -> None:
    ctx = parse_traceparent(f"00-{TRACE}-{SPAN}-{flags}")
    assert ctx is not None and ctx.sampled is sampled


def test_format_round_trips() -> None:
    for ctx in (SpanContext(TRACE, SPAN, True), SpanContext(TRACE, SPAN, False)):
        assert parse_traceparent(ctx.traceparent()) == ctx
    assert SpanContext(TRACE, SPAN).traceparent() == GOOD
    assert SpanContext(TRACE, SPAN, False).traceparent() == f"00-{TRACE}-{SPAN}-00"


def test_a_future_version_is_read_by_its_first_four_fields() -> None:
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-the-future-holds") == SpanContext(TRACE, SPAN, True)


@pytest.mark.parametrize("value", [
    None, "", "garbage", "00", f"00-{TRACE}-{SPAN}",  # absent, empty, too few fields
    f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
    f"ff-{TRACE}-{SPAN}-01",  # version ff is forbidden
    f"0-{TRACE}-{SPAN}-01", f"000-{TRACE}-{SPAN}-01", f"zz-{TRACE}-{SPAN}-01",  # bad version
    f"00-{TRACE[:-1]}-{SPAN}-01", f"00-{TRACE}a-{SPAN}-01",  # trace id of 31 and 33 digits
    f"00-{TRACE}-{SPAN[:-1]}-01", f"00-{TRACE}-{SPAN}0-01",  # parent id of 15 and 17 digits
    f"00-{TRACE}-{SPAN}-1", f"00-{TRACE}-{SPAN}-001", f"00-{TRACE}-{SPAN}-0g",  # bad flags
    f"00-{TRACE.upper()}-{SPAN}-01", f"00-{TRACE}-{SPAN.upper()}-01",  # uppercase hex
    f"00-{TRACE[:-1]}x-{SPAN}-01",  # not hex
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
    "00_" + GOOD[3:],  # wrong separator
    b"\xff\xfe" + GOOD.encode(),  # not ASCII
])
def test_a_malformed_header_is_ignored(value: str | bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_record_headers_round_trip() -> None:
    ctx = SpanContext(TRACE, SPAN, False)
    headers = to_headers(ctx)
    assert headers == (("traceparent", f"00-{TRACE}-{SPAN}-00".encode()),)
    assert from_headers(headers) == ctx
    # other headers are skipped; the first traceparent wins; none: None
    other = SpanContext("a" * 32, "b" * 16)
    assert from_headers([("x-other", b"1"), *to_headers(other), *headers]) == other
    assert from_headers([("x-other", b"1")]) is None
    assert from_headers([]) is None
    assert from_headers([("traceparent", b"00-bad")]) is None


def test_an_ignored_header_starts_a_new_trace() -> None:
    """What the edge and the worker do with a header that did not parse: their span is the root of
    a fresh trace, never a child of the bad ids."""
    got: list = []
    tracer = Tracer(got.append)
    tracer.start("x", parse_traceparent(f"00-{'0' * 32}-{SPAN}-01")).end()
    (r,) = got
    assert r.parent_id == "" and r.trace_id != "0" * 32 and len(r.trace_id) == 32
    assert parse_traceparent(f"00-{r.trace_id}-{r.span_id}-01") is not None  # fresh ids are valid ones


@pytest.mark.parametrize("value, want", [
    ("congo=t61rcWkgMzE", "congo=t61rcWkgMzE"),
    (" rojo=00f067aa0ba902b7 ,, congo=t61rcWkgMzE ", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),  # trimmed, empty dropped
    (b"a@vendor=x", "a@vendor=x"),
    ("", ""), (None, ""),
    ("novalue", ""), ("=v", ""), ("k=", ""), ("k=v,bad", ""),  # a malformed member drops the whole list
    ("Congo=x", ""), ("k=a=b", ""), ("k" * 257 + "=v", ""), ("k=" + "v" * 257, ""),  # key/value grammar
    ("tenant@sys=v", "tenant@sys=v"), ("1tenant@sys=v", "1tenant@sys=v"), ("1k=v", ""),
    ("k=caf\u00e9", ""), ("k=a\tb", ""), (b"k=\xff", ""),  # non-ASCII, non-printable
    (",".join(f"k{i}=v" for i in range(33)), ""),  # more than 32 members
    ("k=" + "v" * 600, ""),  # longer than 512 characters
])
def test_tracestate_is_kept_as_received_or_dropped_whole(value, want: str) -> None:
    assert parse_tracestate(value) == want


def test_tracestate_travels_with_a_valid_traceparent_only() -> None:
    ctx = parse_headers(GOOD, "congo=t61rcWkgMzE")
    assert ctx == SpanContext(TRACE, SPAN, True, "congo=t61rcWkgMzE")
    assert parse_headers(None, "congo=t61rcWkgMzE") is None  # a lone tracestate starts nothing
    assert parse_headers(GOOD, "bad") == SpanContext(TRACE, SPAN, True)  # a bad one is dropped, the parent kept
    # the bus record's headers carry both, and read back equal
    assert to_headers(ctx) == (("traceparent", GOOD.encode()), ("tracestate", b"congo=t61rcWkgMzE"))
    assert from_headers(list(to_headers(ctx))) == ctx
    assert to_headers(SpanContext(TRACE, SPAN)) == (("traceparent", GOOD.encode()),)  # no empty header


def test_a_child_span_carries_the_trace_state_unchanged() -> None:
    got = []
    tracer = Tracer(got.append)
    parent = tracer.start("edge", SpanContext(TRACE, SPAN, True, "congo=t61rcWkgMzE"))
    child = tracer.start("publish", parent)
    child.end()
    parent.end()
    assert [r.trace_state for r in got] == ["congo=t61rcWkgMzE"] * 2
    assert tracer.start("root").context.trace_state == ""
