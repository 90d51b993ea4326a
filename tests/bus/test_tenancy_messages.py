"""Wire fields of the fair, isolated fleet: ``InferenceRequest.weight`` and ``UsageRecord``."""

import pytest

from bus.messages import DecodeError, InferenceRequest, SamplingParams, UsageRecord, decode, encode
from bus.topics import TopicLayout


def _req(**kw: object) -> InferenceRequest:
    return InferenceRequest("r", "m", (1, 2), SamplingParams(), "lockgate.reply.e", **kw)  # type: ignore[arg-type]


def test_weight_defaults_to_one_and_round_trips() -> None:
    assert _req().weight == 1.0
    r = _req(weight=2.5)
    assert decode(encode(r)) == r
    assert _req(weight=3).weight == 3.0 and isinstance(_req(weight=3).weight, float)


@pytest.mark.parametrize("bad", [0, -1, 0.001, 1e6, float("nan"), float("inf"), True, "2"])
def test_weight_is_validated(bad: object) -> None:
    with pytest.raises(ValueError):
        _req(weight=bad)
    data = encode(_req()).replace(b'"weight":1.0', b'"weight":' + (b'0' if bad == 0 else b'-1'))
    with pytest.raises(DecodeError):
        decode(data)


def test_usage_record_round_trips_and_has_its_topic() -> None:
    u = UsageRecord("r", "acme", "m", 1, 10, 5, 8, 1.7e9, "stop", attempt=1, worker_id="w")
    assert decode(encode(u)) == u
    layout = TopicLayout(namespace="ns")
    assert layout.usage_topic == "ns.usage"
    assert "ns.usage" in [s.name for s in layout.model_specs("m")]
