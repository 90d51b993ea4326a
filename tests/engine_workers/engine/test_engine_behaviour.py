"""Engine API behaviour on the tiny model: abort, seeds, stop conditions, bad input, async API."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate_types import SamplingParams
from tests.waiting import wait_until
from tokenization.model_store import ModelError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, max_num_seqs=8))


def drain(engine: Engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished()
    return outs


def test_abort_waiting_and_running_frees_blocks_within_a_step(engine):
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("run", list(range(3, 60)), p)
    engine.add_request("other", list(range(3, 20)), p)
    engine.step()
    engine.step()
    assert engine.kv.tables.get("run")
    assert engine.abort("run")
    assert "run" not in engine.kv.tables  # freed at once, before the next step
    outs = engine.step()
    final = [o for o in outs if o.request_id == "run"]
    assert final and final[0].finished and final[0].finish_reason == "abort"
    engine.add_request("queued", list(range(3, 30)), p)
    assert engine.abort("queued") and not engine.abort("queued")
    rest = drain(engine)
    assert rest["other"][-1].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_busy_time_counts_only_steps_that_ran_a_batch(engine):
    assert not engine.has_unfinished()
    busy = engine.stats.busy_s
    engine.step()  # nothing scheduled: no time counted
    assert engine.stats.busy_s == busy
    engine.add_request("busy", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t0 = time.monotonic()
    drain(engine)
    elapsed = time.monotonic() - t0
    assert 0 < engine.stats.busy_s - busy <= elapsed


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    engine.add_request("alone", [5, 6, 7], p)
    alone = [t for o in drain(engine)["alone"] for t in o.token_ids]
    engine.add_request("noise1", list(range(3, 40)), SamplingParams(temperature=1.0, max_tokens=30))
    engine.add_request("batched", [5, 6, 7], p)
    engine.add_request("noise2", list(range(40, 90)), SamplingParams(temperature=0.7, max_tokens=25))
    batched = [t for o in drain(engine)["batched"] for t in o.token_ids]
    assert alone == batched
    engine.add_request("other-seed", [5, 6, 7], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=30, ignore_eos=True))
    assert [t for o in drain(engine)["other-seed"] for t in o.token_ids] != alone


def test_stop_token_and_length_and_stream_consistency(engine):
    engine.add_request("free", [10, 11, 12], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outs = drain(engine)["free"]
    tokens = [t for o in outs for t in o.token_ids]
    assert [o.seq for o in outs] == list(range(len(tokens))) or outs[-1].seq + len(outs[-1].token_ids) == len(tokens)
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    offsets = [o.text_offset for o in outs]
    assert offsets == sorted(offsets)
    stop_at = tokens[5]
    engine.add_request("stopped", [10, 11, 12], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_at,), ignore_eos=True))
    out = drain(engine)["stopped"]
    got = [t for o in out for t in o.token_ids]
    assert got == tokens[: tokens.index(stop_at) + 1] and out[-1].finish_reason == "stop"


def test_stop_string_never_leaks(engine):
    engine.add_request("ref", [20, 21], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = "".join(o.text for o in drain(engine)["ref"])
    stop = text[10:13]
    assert len(stop) == 3
    engine.add_request("s", [20, 21], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,)))
    outs = drain(engine)["s"]
    assert "".join(o.text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop="STOP"), "stop"),
        (dict(stop=[3]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(engine):
    engine.add_request("good", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty2", [])
    with pytest.raises(ValueError, match=r"context limit is \d+"):
        engine.add_request("long", [3] * engine.max_model_len)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [3, 10**9])
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("good", [3])
    assert len(drain(engine)["good"][-1:]) == 1


def test_model_errors_name_the_path(tmp_path, tiny_model_dir):
    with pytest.raises(ModelError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope" / "x")))
    with pytest.raises(ModelError, match="no config.json"):
        Engine(EngineConfig(model=str(tmp_path)))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match=f"{broken}.*model.safetensors"):
        Engine(EngineConfig(model=str(broken)))
    cfg = (broken / "config.json").read_text().replace('"llama"', '"gpt2"')
    (broken / "config.json").write_text(cfg)
    with pytest.raises(ModelError, match="architecture"):
        Engine(EngineConfig(model=str(broken)))


async def test_async_engine_streams_and_cancel_aborts(engine):
    async with AsyncEngine(engine) as aeng:
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        chunks = [o async for o in aeng.generate("a1", [7, 8, 9], p)]
        assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 12

        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

        streaming = asyncio.Event()

        async def consume():
            async for _ in aeng.generate("a2", [7, 8, 9], long):
                streaming.set()

        task = asyncio.create_task(consume())
        # Cancel once tokens flow, not after a fixed sleep: with the CPU kernels the tiny model
        # finished all 500 tokens within 0.2 s and the task ended before it was cancelled.
        await asyncio.wait_for(streaming.wait(), 30)
        assert "a2" in engine.kv.tables
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: "a2" not in engine.kv.tables, timeout=2.0, interval=0.02)
        assert "a2" not in engine.kv.tables
        with pytest.raises(ValueError, match="empty"):
            await aeng.add_request("bad", [])
