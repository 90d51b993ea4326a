"""SLO admission at the edge (issue #52): a request that cannot meet its tier's TTFT is refused
early (503 + Retry-After) or, with demotion on, queued on a lower tier that can; a request's tier
is chosen per request within its key's; the flags reach the config. Pure."""

from __future__ import annotations

import argparse

import pytest

from bus import WorkerStatus
from edge.admission.shedding import LoadShedder
from edge.config import ConfigError, EdgeConfig
from edge.request import ProtocolError, requested_tier
from edge.ws.protocol import parse_client_frame
from lockgate.slo_options import add_shed_flags, shed_config


def _st(wait: tuple[float, float, float]) -> WorkerStatus:
    return WorkerStatus("w", "m", 0.0, (0, 0, 0), wait)


def test_a_tier_whose_predicted_wait_passes_its_ttft_is_refused_with_the_excess_to_wait() -> None:
    s = LoadShedder("m", (2.0, 5.0, 60.0), slo_ttft_s=(0.5, 2.0, 30.0))
    s.observe(_st((0.8, 1.5, 40.0)), 0.0)
    shed = s.check(0, 0.0)
    assert shed is not None and "0.5s objective" in shed.reason and shed.retry_after == 1.0  # clamped up to 1 s
    assert s.check(1, 0.0) is None  # 1.5 s within p1's 2 s
    shed2 = s.check(2, 0.0)
    assert shed2 is not None and shed2.retry_after == pytest.approx(10.0)  # 40 vs 30
    # without TTFT targets only the wait limits count (the old behaviour)
    plain = LoadShedder("m", (2.0, 5.0, 60.0))
    plain.observe(_st((0.8, 1.5, 40.0)), 0.0)
    assert plain.check(0, 0.0) is None and plain.check(2, 0.0) is None


def test_demotion_queues_a_request_on_the_first_lower_tier_that_can_meet_its_target() -> None:
    s = LoadShedder("m", (2.0, 5.0, 60.0), slo_ttft_s=(0.5, 2.0, 30.0))
    s.observe(_st((0.8, 1.5, 40.0)), 0.0)
    assert s.place(0, 0.0, demote=True) == 1
    assert not isinstance(s.place(0, 0.0), int)  # no demotion: refused
    s.observe(_st((0.8, 2.5, 40.0)), 0.0)
    shed = s.place(0, 0.0, demote=True)
    assert not isinstance(shed, int) and "tier p0" in shed.reason  # nobody can: refused with p0's reason


def test_a_request_names_its_tier_by_priority_or_service_tier() -> None:
    assert requested_tier({}) is None
    assert requested_tier({"priority": 2}) == 2
    assert requested_tier({"service_tier": "flex"}) == 2
    assert requested_tier({"service_tier": "priority"}) == 0
    assert requested_tier({"service_tier": "auto"}) is None
    for bad, field in (({"priority": 3}, "priority"), ({"priority": "high"}, "priority"),
                       ({"priority": True}, "priority"), ({"service_tier": "scale"}, "service_tier"),
                       ({"priority": 1, "service_tier": "flex"}, "priority")):
        with pytest.raises(ProtocolError) as e:
            requested_tier(bad)
        assert e.value.field == field
    frame = parse_client_frame(b'{"type": "generate", "id": "a", "prompt": "hi", "priority": 2}', 16)
    assert frame.tier == 2  # type: ignore[union-attr]


def test_the_shed_flags_reach_the_edge_config(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    add_shed_flags(p, ttft=True)
    cfg = EdgeConfig(model="m", **shed_config(p.parse_args([])))
    assert (cfg.slo_wait_s, cfg.max_queue_depth, cfg.slo_ttft_ms, cfg.slo_demote) == \
        ((2.0, 5.0, 60.0), (0, 0, 0), (500.0, 2000.0, 30000.0), False)
    args = p.parse_args(["--slo-wait", "1,2,3", "--max-queue-depth", "8,16,0", "--slo-ttft-ms", "300,1000,9000",
                         "--slo-demote"])
    cfg = EdgeConfig(model="m", **shed_config(args))
    assert (cfg.slo_wait_s, cfg.max_queue_depth, cfg.slo_ttft_ms, cfg.slo_demote) == \
        ((1.0, 2.0, 3.0), (8, 16, 0), (300.0, 1000.0, 9000.0), True)
    monkeypatch.setenv("LOCKGATE_MAX_QUEUE_DEPTH", "4,4,4")
    monkeypatch.setenv("LOCKGATE_SLO_TTFT_MS", "250,500,1000")
    p2 = argparse.ArgumentParser()
    add_shed_flags(p2, ttft=True)
    cfg = EdgeConfig(model="m", **shed_config(p2.parse_args([])))
    assert cfg.max_queue_depth == (4, 4, 4) and cfg.slo_ttft_ms == (250.0, 500.0, 1000.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-queue-depth", "1,2"])
    with pytest.raises(ConfigError, match="slo_ttft_ms"):
        EdgeConfig(model="m", slo_ttft_ms=(1.0, 2.0))
