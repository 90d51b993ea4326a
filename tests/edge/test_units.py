"""Pure unit tests: key file, auth, rate limits, load shedding, protocol parsing, dedupe, coalescing."""

from __future__ import annotations

import pytest

from bus import TokenChunk, WorkerStatus
from edge.admission.auth import Authenticator, AuthError, extract_key, select_subprotocol
from edge.admission.lifecycle import Stream
from edge.admission.ratelimit import KeyLimiter, TokenBucket
from edge.admission.router import dedupe
from edge.admission.shedding import LoadShedder
from edge.config import (
    ConfigError,
    EdgeConfig,
    KeyEntry,
    add_key,
    hash_key,
    load_keys,
    parse_keys,
)
from edge.request import Generate, ProtocolError
from edge.ws.protocol import CancelFrame, parse_client_frame
from edge.ws.session import _Delta, coalesce, text_frames

# --- config / keys --------------------------------------------------------------------------------

def test_add_key_appends_hashed_entry(tmp_path):
    path = tmp_path / "keys.jsonl"
    key, entry = add_key(path, "acme", 0, requests_per_min=5)
    key2, _ = add_key(path, "beta")
    text = path.read_text()
    assert key not in text and key2 not in text
    keys = load_keys(path)
    assert keys[hash_key(key)].tenant == "acme" and keys[hash_key(key)].tier == 0
    assert keys[hash_key(key)].requests_per_min == 5
    assert keys[hash_key(key2)].tier == 1


@pytest.mark.parametrize("line, word", [
    ("{nope", "not JSON"),
    ('{"tenant": "a"}', "sha256"),
    ('{"sha256": "xyz", "tenant": "a"}', "sha256"),
    ('{"sha256": "%s", "tenant": "a", "tier": 7}' % ("a" * 64), "tier"),
    ('{"sha256": "%s", "tenant": "a", "requests_per_min": -1}' % ("a" * 64), "requests_per_min"),
    ('{"sha256": "%s", "tenant": "a", "colour": 1}' % ("a" * 64), "colour"),
])
def test_bad_key_file_names_line_and_field(line, word):
    with pytest.raises(ConfigError, match=word) as ei:
        parse_keys("# comment\n\n" + line, "k.jsonl")
    assert "k.jsonl:3" in str(ei.value)


def test_missing_key_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read key file"):
        load_keys(tmp_path / "nope")


def test_edge_config_validates():
    with pytest.raises(ConfigError, match="slo_wait_s"):
        EdgeConfig(model="m", slo_wait_s=(1.0, 2.0))
    with pytest.raises(ConfigError, match="port"):
        EdgeConfig(model="m", port=70000)
    assert EdgeConfig(model="m").dev_mode


# --- auth -----------------------------------------------------------------------------------------

def test_extract_key_sources():
    assert extract_key("/ws", {"Authorization": "Bearer abc"}) == "abc"
    assert extract_key("/ws", {"Sec-WebSocket-Protocol": "lockgate.v1, bearer.k1"}) == "k1"
    assert extract_key("/ws?api_key=q1&x=2", {}) == "q1"
    assert extract_key("/ws", {"Authorization": "Basic zzz"}) is None
    assert extract_key("/ws", {}) is None
    assert select_subprotocol(["bearer.k1", "lockgate.v1"]) == "lockgate.v1"
    assert select_subprotocol(["bearer.k1"]) is None


def test_authenticator():
    e = KeyEntry(hash_key("good"), "acme", 0)
    auth = Authenticator({e.key_hash: e})
    assert auth.authenticate("good").tenant == "acme"
    assert auth.authenticate("good").tier == 0
    with pytest.raises(AuthError, match="missing"):
        auth.authenticate(None)
    with pytest.raises(AuthError, match="invalid"):
        auth.authenticate("bad")
    dev = Authenticator(None, dev_tier=2)
    assert dev.authenticate(None).tenant == "dev" and dev.authenticate("x").tier == 2


# --- rate limits ----------------------------------------------------------------------------------

def test_token_bucket_refills():
    b = TokenBucket(60, now=0.0)  # 1/s, capacity 60
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 1.0) == 0.0
    assert b.wait_for(30, 10.0) == pytest.approx(20.0)
    assert TokenBucket(0, 0.0).wait_for(10**9, 0.0) == 0.0  # 0 = unlimited


def test_requests_per_min():
    lim = KeyLimiter(KeyEntry("a" * 64, "t", 1, requests_per_min=2, tokens_per_min=0, max_streams=0), 0.0)
    assert lim.admit(10, 0.0) is None and lim.admit(10, 0.0) is None
    r = lim.admit(10, 0.0)
    assert r is not None and r.field == "requests_per_min" and r.retry_after == pytest.approx(30.0)
    assert lim.admit(10, 30.0) is None


def test_tokens_per_min_and_refund():
    lim = KeyLimiter(KeyEntry("a" * 64, "t", 1, requests_per_min=0, tokens_per_min=600, max_streams=0), 0.0)
    assert lim.admit(500, 0.0) is None
    r = lim.admit(200, 0.0)
    assert r.field == "tokens_per_min" and r.retry_after == pytest.approx(10.0)
    lim.release(400, 0.0)  # used only 100 of 500
    assert lim.admit(200, 0.0) is None
    big = lim.admit(601, 0.0)
    assert big.field == "tokens_per_min" and big.retry_after is None


def test_concurrent_streams():
    lim = KeyLimiter(KeyEntry("a" * 64, "t", 1, requests_per_min=0, tokens_per_min=0, max_streams=1), 0.0)
    assert lim.admit(1, 0.0) is None
    assert lim.admit(1, 0.0).field == "max_streams"
    lim.release(0, 0.0)
    assert lim.admit(1, 0.0) is None


# --- load shedding --------------------------------------------------------------------------------

def _st(wid="w", wait=(0.0, 0.0, 0.0), depth=(0, 0, 0), draining=False, model="m", partitions=0):
    return WorkerStatus(wid, model, 0.0, depth, wait, draining=draining, partitions=partitions)


def test_no_worker_is_overloaded_and_not_ready():
    s = LoadShedder("m", (1.0, 5.0, 60.0), stale_after_s=3.0)
    assert s.check(1, 0.0).retry_after == 3.0
    ok, why = s.readiness(0.0)
    assert not ok and "no worker heartbeat" in why
    s.observe(_st(), 10.0)
    assert s.check(1, 11.0) is None and s.readiness(11.0)[0]
    shed = s.check(1, 14.0)  # stale now: the worker is presumed dead
    assert shed is not None and "last heartbeat 4.0s ago" in shed.reason
    s.observe(_st(model="other"), 14.0)
    assert s.check(1, 14.0) is not None


def test_wait_over_slo_per_tier():
    s = LoadShedder("m", (1.0, 5.0, 60.0))
    s.observe(_st("a", wait=(2.0, 9.0, 9.0)), 0.0)
    s.observe(_st("b", wait=(3.0, 12.0, 9.0)), 0.0)
    assert s.check(0, 0.0).retry_after == pytest.approx(1.5)  # mean wait 2.5 vs 1
    assert s.check(1, 0.0).retry_after == pytest.approx(5.5)  # mean wait 10.5 vs 5
    assert s.check(2, 0.0) is None
    s.observe(_st("c", draining=True), 0.0)  # draining workers take no new work
    assert s.check(1, 0.0) is not None


def test_an_idle_worker_does_not_hide_a_saturated_one():
    """Requests land by partition: the expected wait weighs each worker by the partitions it owns."""
    s = LoadShedder("m", (1.0, 5.0, 60.0))
    s.observe(_st("idle", wait=(0.0, 0.0, 0.0), partitions=2), 0.0)
    s.observe(_st("busy", wait=(0.0, 20.0, 0.0), partitions=6), 0.0)
    shed = s.check(1, 0.0)  # (2 * 0 + 6 * 20) / 8 = 15 s over a 5 s objective
    assert shed is not None and "15.0s" in shed.reason
    s.observe(_st("busy", wait=(0.0, 20.0, 0.0), partitions=1), 0.0)
    s.observe(_st("idle", wait=(0.0, 0.0, 0.0), partitions=7), 0.0)
    assert s.check(1, 0.0) is None  # (7 * 0 + 1 * 20) / 8 = 2.5 s


def test_queue_depth_limit_and_retry_clamp():
    s = LoadShedder("m", (1.0, 5.0, 60.0), max_queue_depth=(0, 10, 0))
    s.observe(_st(depth=(0, 10, 0)), 0.0)
    assert "queue depth" in s.check(1, 0.0).reason
    s.observe(_st(wait=(1000.0, 0, 0)), 0.0)
    assert s.check(0, 0.0).retry_after == 30.0


# --- protocol -------------------------------------------------------------------------------------

def test_parse_generate_and_cancel():
    g = parse_client_frame('{"type":"generate","id":"a","prompt":"hi","max_tokens":5,"temperature":0,"stop":["x"]}')
    assert isinstance(g, Generate) and g.sampling.max_tokens == 5 and g.sampling.greedy and g.prompt == "hi"
    g = parse_client_frame(b'{"type":"generate","id":"b","messages":[{"role":"user","content":"hi"}]}', 77)
    assert g.messages[0].content == "hi" and g.sampling.max_tokens == 77
    assert parse_client_frame('{"type":"cancel","id":"a"}') == CancelFrame("a", None)


@pytest.mark.parametrize("frame, field", [
    ('{"type":"generate","id":"a","prompt":"hi","temperature":-1}', "temperature"),
    ('{"type":"generate","id":"a","prompt":"hi","top_p":2}', "top_p"),
    ('{"type":"generate","id":"a","prompt":"hi","max_tokens":0}', "max_tokens"),
    ('{"type":"generate","id":"a","prompt":"hi","max_tokens":"5"}', "max_tokens"),
    ('{"type":"generate","id":"a","prompt":"hi","logprobs":99}', "logprobs"),
    ('{"type":"generate","id":"a","prompt":"hi","stop":"x"}', "stop"),
    ('{"type":"generate","id":"a","prompt":"hi","seed":-4}', "seed"),
    ('{"type":"generate","id":"a","prompt":"hi","bogus":1}', "bogus"),
    ('{"type":"generate","id":"a"}', "messages"),
    ('{"type":"generate","id":"a","prompt":"x","messages":[]}', "messages"),
    ('{"type":"generate","id":"a","messages":[{"role":"x","content":"y"}]}', "messages[0].role"),
    ('{"type":"generate","id":"a","messages":[{"role":"user","content":5}]}', "messages[0].content"),
    ('{"type":"generate","prompt":"hi"}', "id"),
    ('{"type":"generate","id":5,"prompt":"hi"}', "id"),
    ('{"type":"launch"}', "type"),
    ('{"id":"a"}', "type"),
    ('{"type":"cancel"}', "id"),
])
def test_bad_frames_name_the_field(frame, field):
    with pytest.raises(ProtocolError) as ei:
        parse_client_frame(frame)
    assert ei.value.field == field, ei.value.message
    assert ei.value.code == "invalid_request"


@pytest.mark.parametrize("frame", [b"\xff\xfe", "[1,2]", "null", "", "{", "1e999"])
def test_not_an_object(frame):
    with pytest.raises(ProtocolError) as ei:
        parse_client_frame(frame)
    assert ei.value.field is None


def test_prompt_length_vs_context(encoder):
    from edge.request import PromptEncoder

    small = PromptEncoder(encoder.tokenizer, 8)
    g = parse_client_frame('{"type":"generate","id":"a","prompt":"%s"}' % ("hello world " * 20))
    with pytest.raises(ProtocolError, match="context is 8") as ei:
        small.encode(g)
    assert ei.value.field == "prompt"
    g = parse_client_frame('{"type":"generate","id":"a","messages":[{"role":"user","content":"hi"}]}')
    ids = encoder.encode(g)
    assert encoder.tokenizer.decode(ids).startswith("<|im_start|>user\nhi<|im_end|>")


# --- dedupe / coalescing --------------------------------------------------------------------------

def _chunk(seq, text, off, n=1):
    return TokenChunk("r", 0, seq, tuple(range(seq, seq + n)), text, off)


def test_dedupe_drops_replays_and_trims_overlap():
    s = Stream("r", "c", None, None, ("m", "p1"), 1, 10, 0.0, 1e9, False)
    assert dedupe(s, _chunk(0, "ab", 0)) == (0, "ab", (0,), None)
    assert dedupe(s, _chunk(1, "c", 2)) == (1, "c", (1,), None)
    assert dedupe(s, _chunk(0, "ab", 0)) is None  # replay after a restart
    assert dedupe(s, _chunk(1, "c", 2)) is None
    assert dedupe(s, _chunk(1, "cde", 2, n=3)) == (2, "de", (2, 3), None)  # overlap: trimmed
    assert (s.next_seq, s.chars) == (4, 5)


def test_coalesce_merges_consecutive_deltas_of_one_request():
    frames = coalesce([_Delta("a", 0, "x", [1], None), _Delta("a", 1, "y", [2], None), b"F",
                       _Delta("a", 2, "z", None, None), _Delta("b", 0, "q", None, None)])
    import orjson

    out = [orjson.loads(f) if f != b"F" else "F" for f in frames]
    assert out[0] == {"type": "delta", "id": "a", "seq": 0, "text": "xy", "token_ids": [1, 2]}
    assert out[1] == "F"
    assert [o["text"] for o in out[2:]] == ["z", "q"]


def test_text_frames_match_websockets_framing_and_parse_back():
    from websockets.frames import Frame, Opcode

    # the three length encodings and their boundaries, and several frames in one write
    payloads = [b"", b"x", bytes(125), bytes(126), "é🙂".encode() * 40, bytes(65535), bytes(65536)]
    for p in payloads:
        assert text_frames([p]) == Frame(Opcode.TEXT, p).serialize(mask=False, extensions=[])
    assert text_frames(payloads) == b"".join(text_frames([p]) for p in payloads)


def test_fast_chunk_decode_matches_bus_decode():
    from bus import (
        DecodeError,
        Error,
        Finished,
        ReplyBatch,
        Usage,
        decode,
        encode,
        replies_of,
    )
    from edge.admission.router import decode_reply

    chunks = (TokenChunk("r", 1, 3, (5, 6), "héllo 🙂", 7, None, "w1"), TokenChunk("s", 0, 0, (1,), "x", 0))
    for msg in (*chunks,
                TokenChunk("r", 0, 0, (1,), "x", 0, ((( 1, -0.5),),), "w"),
                Finished("r", 0, "stop", 3, Usage(1, 3)),
                ReplyBatch(chunks),  # the fast path
                ReplyBatch(chunks, (Finished("s", 0, "stop", 1, Usage(1, 1)),), (Error("r", "internal", "boom"),)),
                ReplyBatch((TokenChunk("r", 0, 0, (1,), "x", 0, ((( 1, -0.5),),), "w"),))):
        assert decode_reply(encode(msg)) == replies_of(decode(encode(msg)))
    assert decode_reply(encode(ReplyBatch(chunks))) == chunks
    chunk = b'{"request_id":"r","attempt":0,"seq":0,"token_ids":[1],"text":"","text_offset":0}'
    for bad in (b'{"v":1,"type":"chunk","request_id":"r","attempt":0,"seq":"0","token_ids":[1],"text":"","text_offset":0}',
                b'{"v":1,"type":"chunk","request_id":"r","attempt":0,"seq":0,"token_ids":[1],"text":"","text_offset":0,"x":1}',
                b'{"v":1,"type":"replies","chunks":[' + chunk + b',' + chunk.replace(b'"seq":0', b'"seq":"1"') + b']}',  # one bad: all bad
                b'{"v":1,"type":"replies","chunks":{}}',
                b'{"v":1,"type":"replies","chunks":[],"more":1}',
                b"nope"):
        with pytest.raises(DecodeError):
            decode_reply(bad)


async def test_tick_flusher_flushes_each_session_once_per_tick_and_isolates_failures():
    import asyncio

    from edge.ws.session import TickFlusher

    class FakeSession:
        def __init__(self, name: str, broken: bool = False) -> None:
            self.name, self.broken, self.flushes, self.killed = name, broken, 0, None
            self._pending = ["frame"]
            self.principal = type("P", (), {"tenant": name})()

        def _flush(self) -> None:
            self.flushes += 1
            if self.broken:
                raise RuntimeError("boom")
            self._pending = None

        def kill(self, code: int, reason: str) -> None:
            self.killed = code

    flusher = TickFlusher()
    a, bad, b = FakeSession("a"), FakeSession("bad", broken=True), FakeSession("b")
    for s in (a, bad, b):
        flusher.add(s)
    assert a.flushes == 0  # nothing runs before the loop's next tick
    await asyncio.sleep(0)  # exactly one loop tick (the unit under test), not a wait for time
    assert (a.flushes, bad.flushes, b.flushes) == (1, 1, 1)  # the broken one did not stop b
    assert bad.killed == 1011 and bad._pending is None and a.killed is None and b.killed is None
    flusher.add(a)  # a new tick schedules a new run
    await asyncio.sleep(0)  # one tick
    assert a.flushes == 2 and b.flushes == 1


async def test_fake_worker_steps_on_its_phase_grid():
    """`bench edge --workers N`: worker k steps at k * step / N + j * step of the monotonic clock, so a
    fleet's bursts interleave; without a phase a worker steps as soon as work arrives."""
    from bus import MemoryBus
    from devtools.fake_worker import FakeWorker

    bus = MemoryBus()
    at_once = FakeWorker(bus, "m", step_s=0.02)
    assert at_once._first_step_at(100.013) == 100.013
    second = FakeWorker(bus, "m", step_s=0.02, step_phase_s=0.01)
    assert second._first_step_at(100.013) == pytest.approx(100.03)
    assert second._first_step_at(100.03) == pytest.approx(100.03)
    assert FakeWorker(bus, "m", step_s=0.02, step_phase_s=0.0)._first_step_at(100.013) == pytest.approx(100.02)
    for bad in (-0.001, 0.02, 0.5):
        with pytest.raises(ValueError, match="step_phase_s"):
            FakeWorker(bus, "m", step_s=0.02, step_phase_s=bad)
