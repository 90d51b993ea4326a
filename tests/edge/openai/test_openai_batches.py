"""The Files and Batches API through the official ``openai`` SDK: memory bus, the fake worker
(output a pure function of the prompt, ``expected_text``). Lines with bad bodies are answered in
the error file with the live endpoint's own refusal; bad files fail at validation; pagination,
cancel, delete, keys; a batch survives its edge being replaced mid-run."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator

import openai
import pytest

from bus import MemoryBus, Tier, TopicLayout
from devtools.fake_worker import FakeWorker, expected_text
from edge.config import EdgeConfig
from edge.server import Edge
from tests.edge.conftest import KEY, KEY_P0, MODEL, keys
from tests.edge.openai.test_openai import api, base_url, chat_ids
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def chat_line(cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def mixed_lines(n_valid: int = 44) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
    """``n_valid`` good chat lines and six the endpoint refuses; (lines, valid by id, invalid by id)."""
    valid = {f"ok-{i}": {"model": MODEL, "messages": [{"role": "user", "content": f"question number {i}"}],
                         "max_tokens": 2 + i % 5, "temperature": 0} for i in range(n_valid)}
    invalid = {
        "bad-temp": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        "bad-top-p": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 7},
        "bad-model": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        "bad-messages": {"model": MODEL, "messages": "not a list"},
        "bad-role": {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        "no-messages": {"model": MODEL},
    }
    lines = [chat_line(c, b) for c, b in valid.items()]
    for i, (c, b) in enumerate(invalid.items()):  # spread through the file
        lines.insert(7 * i + 3, chat_line(c, b))
    return lines, valid, invalid


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


async def upload(client: openai.AsyncOpenAI, data: bytes, name: str = "in.jsonl"):
    return await client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60.0):
    out = {}

    async def done() -> bool:
        out["b"] = await client.batches.retrieve(batch_id)
        return out["b"].status in ("completed", "failed", "cancelled", "expired")

    await wait_until(done, timeout=timeout, interval=0.05)
    return out["b"]


async def read_jsonl(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    raw = await client.files.content(file_id)
    return [json.loads(x) for x in raw.content.decode().splitlines() if x.strip()]


async def live_error(client: openai.AsyncOpenAI, body: dict) -> tuple[int, dict]:
    """What the live endpoint answers for ``body`` (status and JSON body)."""
    try:  # raw, past the SDK's own argument checks: the body exactly as the batch line has it
        await client.post("/chat/completions", body=body, cast_to=object)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.json()
    raise AssertionError(f"the live endpoint accepted {body}")


async def check_mixed_result(client: openai.AsyncOpenAI, encoder, batch, valid: dict, invalid: dict) -> None:
    assert batch.status == "completed", batch
    assert batch.request_counts.total == len(valid) + len(invalid)
    assert batch.request_counts.completed == len(valid) and batch.request_counts.failed == len(invalid)
    out = await read_jsonl(client, batch.output_file_id)
    errs = await read_jsonl(client, batch.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(valid), "every valid line answered exactly once"
    assert sorted(r["custom_id"] for r in errs) == sorted(invalid), "every invalid line in the error file"
    for r in out:
        body = valid[r["custom_id"]]
        completion = openai.types.chat.ChatCompletion.model_validate(r["response"]["body"])  # the SDK parses it
        want = expected_text(chat_ids(encoder, body["messages"]), body["max_tokens"])
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert completion.choices[0].message.content == want
        assert completion.usage.completion_tokens == body["max_tokens"]
    for r in errs:
        status, live = await live_error(client, invalid[r["custom_id"]])
        assert (r["response"]["status_code"], r["response"]["body"]) == (status, live), r["custom_id"]


async def test_a_mixed_batch_completes_with_the_sdk(encoder) -> None:
    async with api(encoder) as (edge, fw, client):
        lines, valid, invalid = mixed_lines()
        f = await upload(client, jsonl(lines))
        assert f.purpose == "batch" and f.bytes == len(jsonl(lines)) and f.status == "processed"
        assert (await client.files.retrieve(f.id)).filename == "in.jsonl"
        assert (await client.files.content(f.id)).content == jsonl(lines)
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "nightly"})
        assert b.status == "validating" and b.metadata == {"job": "nightly"} and b.object == "batch"
        done = await finished(client, b.id)
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
        await check_mixed_result(client, encoder, done, valid, invalid)
        assert fw is not None
        batch_reqs = [r for r in fw.seen if r.tier == int(Tier.P2)]
        assert len(batch_reqs) == len(valid), "each valid line ran once, at p2"
        assert all(r.tenant == "acme" for r in batch_reqs)  # the key's tenant: its fair share and limits
        listed = await client.files.list(purpose="batch_output")
        assert {x.id for x in listed.data} == {done.output_file_id, done.error_file_id}


@pytest.mark.parametrize(("url", "body", "check"), [
    ("/v1/completions", {"model": MODEL, "prompt": "once upon", "max_tokens": 3, "temperature": 0},
     lambda body: openai.types.Completion.model_validate(body).choices[0].text),
    ("/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 4},
     lambda body: body["object"] == "response" and "".join(
         p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])),
])
async def test_other_endpoints_run_as_batches(encoder, url, body, check) -> None:
    async with api(encoder) as (_edge, _fw, client):
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": url, "body": body} for i in range(3)]
        lines.append({"custom_id": "bad", "method": "POST", "url": url, "body": {**body, "model": "nope"}})
        f = await upload(client, jsonl(lines))
        b = await finished(client, (await client.batches.create(input_file_id=f.id, endpoint=url,
                                                                completion_window="24h")).id)
        assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 1)
        out = await read_jsonl(client, b.output_file_id)
        assert sorted(r["custom_id"] for r in out) == ["c0", "c1", "c2"] and all(check(r["response"]["body"]) for r in out)
        (err,) = await read_jsonl(client, b.error_file_id)
        assert err["custom_id"] == "bad" and err["response"]["status_code"] == 404


@pytest.mark.parametrize(("data", "code", "line"), [
    (jsonl([chat_line("a", {"model": MODEL, "messages": []})]) + b"{not json\n", "invalid_json_line", 2),
    (jsonl([chat_line("a", {}), {**chat_line("b", {}), "url": "/v1/completions"}]), "invalid_url", 2),
    (jsonl([chat_line("a", {}), chat_line("a", {})]), "duplicate_custom_id", 2),
    (jsonl([{"method": "POST", "url": "/v1/chat/completions", "body": {}}]), "missing_required_parameter", 1),
    (b"\n\n", "empty_file", None),
])
async def test_a_bad_file_fails_the_batch_at_validation(encoder, data, code, line) -> None:
    async with api(encoder) as (_edge, fw, client):
        f = await upload(client, data)
        b = await finished(client, (await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                                completion_window="24h")).id)
        assert b.status == "failed" and b.failed_at and b.output_file_id is None
        assert b.errors is not None and b.errors.data[0].code == code and b.errors.data[0].line == line
        assert fw is not None and not fw.seen, "nothing of a failed batch runs"


async def test_create_refuses_bad_requests(encoder) -> None:
    async with api(encoder) as (_edge, _fw, client):
        f = await upload(client, jsonl([chat_line("a", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})]))
        good = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        for bad, param in (({"endpoint": "/v1/moderations"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                           ({"input_file_id": "file-nope"}, "input_file_id"),
                           ({"metadata": {"k": 1}}, "metadata")):
            with pytest.raises(openai.APIStatusError) as e:
                await client.batches.create(**{**good, **bad})
            assert e.value.status_code in (400, 404) and e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError):
            await client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")


async def test_list_paginates_newest_first(encoder) -> None:
    async with api(encoder, worker=False) as (_edge, _fw, client):
        f = await upload(client, jsonl([chat_line("a", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})]))
        made = [(await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")).id for _ in range(5)]
        first = await client.batches.list(limit=2)
        assert len(first.data) == 2 and first.has_more
        seen = [b.id async for b in await client.batches.list(limit=2)]  # the SDK follows ``after``
        assert sorted(seen) == sorted(made) and len(seen) == 5
        after = await client.batches.list(after=seen[1], limit=10)
        assert [b.id for b in after.data] == seen[2:] and not after.has_more
        with pytest.raises(openai.BadRequestError):
            await client.batches.list(limit=0)


async def test_cancel_stops_the_batch_and_keeps_what_ran(encoder) -> None:
    async with api(encoder, worker_kw={"step_s": 0.05}) as (_edge, fw, client):
        lines = [chat_line(f"r{i}", {"model": MODEL, "messages": [{"role": "user", "content": f"n{i}"}],
                                      "max_tokens": 20}) for i in range(30)]
        f = await upload(client, jsonl(lines))
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        await wait_until(lambda: fw is not None and len(fw.seen) >= 2, timeout=30)
        c = await client.batches.cancel(b.id)
        assert c.status == "cancelling" and c.cancelling_at
        done = await finished(client, b.id)
        assert done.status == "cancelled" and done.cancelled_at
        out = await read_jsonl(client, done.output_file_id)
        errs = await read_jsonl(client, done.error_file_id)
        assert len(out) + len(errs) == 30 and len(errs) > 0
        assert all(e["error"]["code"] == "batch_cancelled" for e in errs)
        assert sorted(r["custom_id"] for r in out + errs) == sorted(f"r{i}" for i in range(30))
        assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errs))
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(b.id)


async def test_delete_and_other_keys_see_nothing(encoder) -> None:
    async with api(encoder) as (edge, _fw, client), \
            openai.AsyncOpenAI(base_url=base_url(edge), api_key=KEY_P0, max_retries=0, timeout=20) as other:
        f = await upload(client, jsonl([chat_line("a", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 2})]))
        b = await finished(client, (await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                                completion_window="24h")).id)
        for call in (other.files.retrieve(f.id), other.files.content(f.id), other.files.delete(f.id),
                     other.batches.retrieve(b.id), other.batches.cancel(b.id),
                     other.files.content(b.output_file_id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await other.files.list()).data == [] and (await other.batches.list()).data == []
        with pytest.raises(openai.NotFoundError):  # another tenant's file cannot feed a batch
            await other.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        gone = await client.files.delete(f.id)
        assert gone.deleted and gone.id == f.id
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(f.id)
        with pytest.raises(openai.NotFoundError):
            await client.files.content(f.id)
        assert (await client.batches.retrieve(b.id)).status == "completed"  # the batch and its output stay
        async with openai.AsyncOpenAI(base_url=base_url(edge), api_key="lg-wrong", max_retries=0) as nobody:
            with pytest.raises(openai.AuthenticationError):
                await nobody.files.list()


async def test_an_upload_over_the_cap_is_refused_and_a_large_one_is_chunked(encoder) -> None:
    async with api(encoder, worker=False, max_file_bytes=3 << 20) as (edge, _fw, client):
        line = json.dumps(chat_line("x" * 500, {"model": MODEL, "messages": [{"role": "user", "content": "y" * 2000}]}))
        big = b"".join((line.replace("x" * 500, f"{i:0500d}") + "\n").encode() for i in range(1000))  # ~2.6 MB
        assert 2 << 20 < len(big) < 3 << 20
        f = await upload(client, big)
        assert (await client.files.content(f.id)).content == big
        store = edge.openai.batches.store  # type: ignore[union-attr]
        assert store.file("acme", f.id).blob.chunks > 1, "stored in several records"
        with pytest.raises(openai.APIStatusError) as e:
            await upload(client, big + big)
        assert e.value.status_code == 413


@contextlib.asynccontextmanager
async def edge_on(bus: MemoryBus, encoder, **cfg) -> AsyncIterator[Edge]:
    config = EdgeConfig(model=MODEL, port=0, openai_port=0, keys=keys(), ping_interval_s=None, **cfg)
    async with Edge(config, bus, encoder) as edge:
        await wait_until(lambda: edge.readiness()[0], timeout=10)
        yield edge


async def test_a_batch_survives_its_edge_being_replaced(encoder) -> None:
    """Edge A takes the batch and stops mid-run; edge B (same bus) resumes it: every line once."""
    bus = MemoryBus()
    await bus.start()
    fw = FakeWorker(bus, MODEL, step_s=0.02)
    await fw.start()
    try:
        lines, valid, invalid = mixed_lines()
        async with edge_on(bus, encoder) as a, \
                openai.AsyncOpenAI(base_url=base_url(a), api_key=KEY, max_retries=0, timeout=20) as ca:
            f = await upload(ca, jsonl(lines))
            bid = (await ca.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")).id
            await wait_until(lambda: len(fw.seen) >= 12, timeout=30)
        async with edge_on(bus, encoder) as b, \
                openai.AsyncOpenAI(base_url=base_url(b), api_key=KEY, max_retries=0, timeout=20) as cb:
            done = await finished(cb, bid)
            await check_mixed_result(cb, encoder, done, valid, invalid)
    finally:
        await fw.stop()
        await bus.stop()


async def test_a_batch_past_its_window_expires_with_what_ran(encoder) -> None:
    async with api(encoder, worker_kw={"step_s": 0.05}) as (edge, fw, client):
        lines = [chat_line(f"r{i}", {"model": MODEL, "messages": [{"role": "user", "content": f"n{i}"}],
                                      "max_tokens": 20}) for i in range(20)]
        f = await upload(client, jsonl(lines))
        bid = (await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")).id
        await wait_until(lambda: fw is not None and len(fw.seen) >= 2, timeout=30)
        store = edge.openai.batches.store  # type: ignore[union-attr]
        b = store.batch(bid)
        await store.put_batch(dataclasses.replace(b, expires_at=int(time.time()) - 1))  # its 24 h have passed
        done = await finished(client, bid)
        assert done.status == "expired" and done.expired_at
        out, errs = await read_jsonl(client, done.output_file_id), await read_jsonl(client, done.error_file_id)
        assert len(out) + len(errs) == 20 and errs and all(e["error"]["code"] == "batch_expired" for e in errs)


async def test_a_line_answer_larger_than_a_record_is_kept_as_a_blob() -> None:
    from edge.openai.batches.model import BatchObject
    from edge.openai.batches.store import BatchStore, LineResult

    async with MemoryBus() as bus:
        store = BatchStore(bus, TopicLayout(namespace="tbig", partitions=2))
        await store.start()
        try:
            b = BatchObject("batch_x", "t", "0" * 64, "/v1/embeddings", "file-x", "24h", int(time.time()),
                            int(time.time()) + 60)
            big = {"custom_id": "a", "response": {"body": {"data": [0.125] * 200_000}}}
            await store.add_result(b.id, LineResult(1, True, big))
            await store.add_result(b.id, LineResult(2, False, {"custom_id": "b"}))
            await store.add_result(b.id, LineResult(1, True, {"custom_id": "a", "again": True}))  # a second answer
            got = await store.results(b)
            assert got[1].record == big and got[2].record == {"custom_id": "b"}, "the first answer of a line wins"
        finally:
            await store.stop()


async def test_the_keys_limits_apply_a_passing_refusal_waits_and_a_final_one_is_the_answer(encoder) -> None:
    """``max_streams`` 1 with three lines in flight: the lines over it are refused with
    Retry-After (429) and run later, never in the error file; a line larger than the key's
    ``tokens_per_min`` can never pass: its 429 is its answer, at once."""
    async with api(encoder, keys=keys(max_streams=1, tokens_per_min=400), batch_max_in_flight=3) as (_e, fw, client):
        lines = [chat_line(f"r{i}", {"model": MODEL, "messages": [{"role": "user", "content": f"n{i}"}],
                                      "max_tokens": 4}) for i in range(6)]
        lines.append(chat_line("huge", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": 500}))
        f = await upload(client, jsonl(lines))
        b = await finished(client, (await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                                completion_window="24h")).id, timeout=90)
        assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (6, 1)
        (err,) = await read_jsonl(client, b.error_file_id)
        assert err["custom_id"] == "huge" and err["response"]["status_code"] == 429
        assert "the key allows 400/min" in err["response"]["body"]["error"]["message"]
