"""One typed, versioned request record and its evolution rules (docs/bus.md, "Record evolution"):
every record round-trips; an older record reads with defaults; a newer writer's record reads on an
older reader with its unknown fields ignored, unless it names one in ``must``; a record of this
revision or older is strict."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
import pytest

from bus import (
    SCHEMA_VERSION,
    Cancel,
    ChatMessage,
    DecodeError,
    Error,
    Finished,
    InferenceRequest,
    ReplyBatch,
    SamplingParams,
    Timings,
    TokenChunk,
    Usage,
    UsageRecord,
    WorkerStatus,
    decode,
    encode,
)
from bus.evolution import knows, must_list
from lockgate_types import SamplingParams as SharedParams
from lockgate_types.evolution import must_understand

REQ = InferenceRequest(
    "r1", "m", (1, 2, 3),
    SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("x",), logit_bias={9: 1.0, 2: -1.0},
                   guided_choice=("a", "b")),
    "reply.e1", tenant="t", tier=0, enqueued_at=1.5, deadline=9.0, prompt_text="hi",
    messages=(ChatMessage("user", "hi"),), cache_salt="s", attempt=2, weight=2.0,
)


def _obj(msg) -> dict:
    return orjson.loads(encode(msg))


def _bytes(obj: dict) -> bytes:
    return orjson.dumps(obj)


@pytest.mark.parametrize("msg", [
    REQ,
    TokenChunk("r1", 0, 0, (5, 6), "ab", 0, ((( 5, -0.1),), ((6, -0.2),)), "w"),
    Finished("r1", 0, "stop", 2, Usage(3, 2, 1), Timings(0.1, 0.2, 0.3, 0.4), "w", (0.6, 0.8)),
    Error("r1", "internal", "boom", 1, 2.0, "w"),
    Cancel("r1", "operator"),
    WorkerStatus("w", "m", 1.0, (1, 2, 3), (0.1, 0.2, 0.3), 4, 8, 0.5, 10, 5, 9.5, True, (0, 1, 2), 3),
    ReplyBatch((TokenChunk("r1", 0, 0, (5,), "a", 0),), (Finished("r2", 0, "length", 1, Usage(1, 1)),)),
    UsageRecord("r1", "t", "m", 1, 3, 2, 0, 1.0, "stop", 1, "w"),
])
def test_every_record_round_trips_with_its_version_and_no_must(msg) -> None:
    obj = _obj(msg)
    assert obj["v"] == SCHEMA_VERSION and "must" not in obj
    assert decode(encode(msg)) == msg


def test_the_request_carries_the_one_shared_sampling_type() -> None:
    back = decode(encode(REQ))
    assert isinstance(back, InferenceRequest)
    assert type(back.sampling) is SharedParams  # what the engine's sampler reads, no conversion
    assert back.sampling.logit_bias == ((2, -1.0), (9, 1.0))  # normalised once, on construction


def test_an_older_record_reads_with_the_defaults_of_its_missing_fields() -> None:
    obj = _obj(REQ)
    for name in ("tenant", "tier", "enqueued_at", "deadline", "prompt_text", "messages", "cache_salt",
                 "attempt", "weight"):
        del obj[name]
    del obj["sampling"]["min_p"], obj["sampling"]["pooling"]
    back = decode(_bytes(obj))
    assert isinstance(back, InferenceRequest)
    assert (back.tenant, back.tier, back.attempt, back.weight, back.deadline) == ("anonymous", 1, 0, 1.0, None)
    assert back.sampling.min_p == 0.0 and back.sampling.pooling is None and back.sampling.seed == 3


def test_required_fields_stay_required() -> None:
    obj = _obj(REQ)
    del obj["reply_to"]
    with pytest.raises(DecodeError, match="reply_to"):
        decode(_bytes(obj))


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_record_of_this_revision_refuses_an_unknown_field(where: str) -> None:
    obj = _obj(REQ)
    (obj if where == "top" else obj["sampling"])["adapter"] = "x"
    with pytest.raises(DecodeError, match="unknown field.*adapter"):
        decode(_bytes(obj))


def test_a_newer_writers_record_reads_on_this_build_with_unknown_fields_ignored() -> None:
    obj = _obj(REQ)
    obj["v"] = SCHEMA_VERSION + 1
    obj["resume_from"] = 4  # fields a later revision added, at the top and inside the sampling
    obj["sampling"]["draft_tokens"] = 3
    obj["messages"][0]["name"] = "n"
    assert decode(_bytes(obj)) == REQ


def test_a_newer_record_still_has_its_known_fields_checked() -> None:
    obj = _obj(REQ)
    obj["v"] = SCHEMA_VERSION + 1
    obj["sampling"]["top_p"] = 7
    with pytest.raises(DecodeError, match="top_p"):
        decode(_bytes(obj))


def test_a_newer_record_naming_an_unknown_must_understand_field_is_refused() -> None:
    obj = _obj(REQ)
    obj.update(v=SCHEMA_VERSION + 1, must=["sampling.adapter"])
    obj["sampling"]["adapter"] = "sql-lora"
    with pytest.raises(DecodeError, match=r"needs field\(s\) \['sampling.adapter'\].*upgrade this reader"):
        decode(_bytes(obj))
    obj["must"] = ["sampling.seed", "tier"]  # fields this build knows: it understands them
    assert decode(_bytes(obj)) == REQ


@pytest.mark.parametrize("must", ["adapter", [""], [1], {}])
def test_a_malformed_must_list_is_refused(must) -> None:
    obj = _obj(REQ)
    obj["must"] = must
    with pytest.raises(DecodeError, match="must"):
        decode(_bytes(obj))


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None])
def test_an_unreadable_version_is_refused(version) -> None:
    obj = _obj(Cancel("r"))
    if version is None:
        del obj["v"]
    else:
        obj["v"] = version
    with pytest.raises(DecodeError, match="unsupported schema version"):
        decode(_bytes(obj))


def test_an_unknown_record_type_from_a_newer_writer_is_refused() -> None:
    with pytest.raises(DecodeError, match="unknown message type 'speculate'"):
        decode(b'{"v":%d,"type":"speculate","request_id":"r"}' % (SCHEMA_VERSION + 1))


# -- the writer's side: a must-understand field named when set ------------------------------------


@dataclass(frozen=True, slots=True)
class _Inner:
    temperature: float = 1.0
    adapter: str | None = field(default=None, metadata=must_understand())


@dataclass(frozen=True, slots=True)
class _Record:
    request_id: str
    sampling: _Inner = field(default_factory=_Inner)
    inner: _Inner | None = None
    tier_hint: int = field(default=0, metadata=must_understand())


def test_the_writer_names_exactly_the_must_understand_fields_that_are_set() -> None:
    assert must_list(_Record("r")) == []
    assert must_list(_Record("r", _Inner(0.5))) == []
    assert must_list(_Record("r", _Inner(adapter="a"), _Inner(adapter="b"), tier_hint=1)) == [
        "sampling.adapter", "inner.adapter", "tier_hint"]
    assert must_list(REQ) == []  # no must-understand field of REQ is set


def test_known_paths_follow_nested_records() -> None:
    assert knows(_Record, "sampling.adapter") and knows(_Record, "inner.temperature")
    assert not knows(_Record, "sampling.nope") and not knows(_Record, "request_id.x")
    assert knows(InferenceRequest, "sampling.pooling") and not knows(InferenceRequest, "adapter")


def test_a_request_for_a_lora_adapter_names_it_in_must() -> None:
    """Revision 2's ``lora``: a worker that does not know it refuses the record (the test above, for
    any unknown name) instead of serving the base model; unset, the record has no ``must``."""
    from dataclasses import replace

    req = replace(REQ, lora="sql-adapter")
    obj = _obj(req)
    assert obj["must"] == ["lora"] and obj["lora"] == "sql-adapter"
    assert decode(encode(req)) == req
    assert "must" not in _obj(REQ)
    with pytest.raises(ValueError, match="lora"):
        replace(REQ, lora="")
    status = WorkerStatus("w", "m", 1.0, loras=("a", "b"))
    assert decode(encode(status)) == status
