"""OffsetTracker: commit only up to the lowest offset still in flight."""

from engine_workers.worker.offsets.watermark import OffsetTracker

A, B = ("t", 0), ("t", 1)


def test_low_watermark_waits_for_oldest() -> None:
    t = OffsetTracker()
    for o in range(5, 10):
        t.track(A, o)
    assert t.committable() == {}
    t.finish(A, 6)
    t.finish(A, 7)
    assert t.committable() == {}  # 5 still in flight
    t.finish(A, 5)
    assert t.committable() == {A: 8}
    t.committed({A: 8})
    assert t.committable() == {}
    t.finish(A, 9)
    assert t.low_watermark(A) == 8
    t.finish(A, 8)
    assert t.committable() == {A: 10}


def test_partitions_independent_and_forget() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.track(B, 3)
    t.finish(B, 3)
    assert t.committable() == {B: 4}
    t.forget([A])
    assert not t.finish(A, 0)
    assert t.partitions() == [B]
    assert t.in_flight() == 0


def test_seen_and_redelivery() -> None:
    t = OffsetTracker()
    t.track(A, 10)
    t.track(A, 11)
    t.finish(A, 11)
    assert t.seen(A, 10) and t.seen(A, 11) and not t.seen(A, 12)
    t.track(A, 10)  # duplicate track is a no-op
    assert t.in_flight(A) == 1
    t.finish(A, 10)
    assert t.committable() == {A: 12}
    assert not t.finish(A, 10)


def test_queued_records_hold_the_watermark() -> None:
    """A record still in the intake (tracked, not finished) blocks commits past it."""
    t = OffsetTracker()
    for o in range(3):
        t.track(A, o)
    t.finish(A, 0)
    t.finish(A, 2)
    assert t.committable() == {A: 1}
