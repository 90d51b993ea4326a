"""The Batch API end to end over real Kafka: the ``openai`` SDK -> edge -> Kafka -> two real workers
(tiny model, their own processes). A batch of 56 lines, 6 of them refused by the endpoint, runs
through a worker killed with SIGKILL and its edge replaced by another (a new bus connection, as a
restarted process): every valid line is answered exactly once with the engine's own greedy output,
every invalid one is in the error file with the live endpoint's refusal."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from bus import ChatMessage, TopicLayout, connect
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from lockgate_types import SamplingParams
from tests.edge.conftest import KEY, keys
from tests.edge.openai.test_openai import base_url
from tests.edge.openai.test_openai_batches import finished, jsonl, live_error, mixed_lines, read_jsonl, upload
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout, two_workers
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixtures, used by name
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]


@contextlib.asynccontextmanager
async def edge_process(bootstrap: str, layout: TopicLayout, encoder: PromptEncoder) -> AsyncIterator[
        tuple[Edge, openai.AsyncOpenAI]]:
    """An edge on a bus connection of its own (as a separate process has), with an SDK client."""
    async with connect(kafka_url(bootstrap)) as bus:
        # two lines at a time: the batch lasts long enough on a quiet machine for the kill to land mid-batch
        cfg = EdgeConfig(model=MODEL, port=0, openai_port=0, layout=layout, keys=keys(), ping_interval_s=None,
                         batch_max_in_flight=2)
        async with Edge(cfg, bus, encoder) as edge:
            await wait_until(lambda: edge.readiness()[0], timeout=30)
            async with openai.AsyncOpenAI(base_url=base_url(edge), api_key=KEY, max_retries=0, timeout=60) as client:
                yield edge, client


async def test_a_batch_survives_a_worker_kill_and_an_edge_restart(kafka_bootstrap: str, tiny_dir: Path,
                                                                   tmp_path: Path) -> None:
    layout = new_layout(2)
    encoder = PromptEncoder.from_path(str(tiny_dir))
    lines, valid, invalid = mixed_lines(50)
    for body in valid.values():
        body["max_tokens"] += 40
        body["ignore_eos"] = True
    # the engine's own greedy output for every valid line: what an exact resume must reproduce
    prompts = [encoder.chat_ids([ChatMessage(m["role"], m["content"]) for m in b["messages"]]) for b in valid.values()]
    ref = make_engine(tiny_dir).generate(prompts, [SamplingParams(max_tokens=b["max_tokens"], temperature=0.0,
                                                                  ignore_eos=True) for b in valid.values()])
    want = {cid: r.text for cid, r in zip(valid, ref, strict=True)}
    async with two_workers(kafka_bootstrap, tiny_dir, layout, tmp_path) as (_bus, procs, _replies):
        async with edge_process(kafka_bootstrap, layout, encoder) as (_edge_a, client_a):
            f = await upload(client_a, jsonl(lines))
            bid = (await client_a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")).id

            async def some_done() -> bool:
                return (await client_a.batches.retrieve(bid)).request_counts.completed >= 8

            await wait_until(some_done, timeout=120, interval=0.1)
            procs["wa"].send_signal(signal.SIGKILL)  # its requests in hand are re-run by wb, exactly
            b = await client_a.batches.retrieve(bid)
            assert b.status == "in_progress" and b.request_counts.completed < len(valid), "stopped mid-batch"
        # edge A is gone (its lines in flight cancelled); a new edge process takes the batch up
        async with edge_process(kafka_bootstrap, layout, encoder) as (_edge_b, client_b):
            done = await finished(client_b, bid, timeout=300)
            assert done.status == "completed", done
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
                len(lines), len(valid), len(invalid))
            out = await read_jsonl(client_b, done.output_file_id)
            errs = await read_jsonl(client_b, done.error_file_id)
            assert sorted(r["custom_id"] for r in out) == sorted(valid), "every valid line answered exactly once"
            assert sorted(r["custom_id"] for r in errs) == sorted(invalid), "every invalid line in the error file"
            for r in out:
                c = openai.types.chat.ChatCompletion.model_validate(r["response"]["body"])  # the SDK parses it
                assert c.choices[0].message.content == want[r["custom_id"]], r["custom_id"]
                assert c.usage.completion_tokens == valid[r["custom_id"]]["max_tokens"]
            for r in errs:
                assert (r["response"]["status_code"], r["response"]["body"]) == await live_error(
                    client_b, invalid[r["custom_id"]]), r["custom_id"]
