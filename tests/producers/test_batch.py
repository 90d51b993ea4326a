"""Batch jobs on real Kafka: 47 results + 3 error records; SIGKILL midway and rerun -> exactly 50."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import bus as busmod
from producers.batch import BatchConfig, run_batch
from tests.producers.conftest import serving
from tests.waiting import wait_until

pytestmark = pytest.mark.kafka

BAD = {7: "{this is not json", 20: "unknown url", 33: "invalid params"}


def write_input(path: Path, n: int = 50, max_tokens: int = 12) -> None:
    lines = []
    for i in range(1, n + 1):
        if i == 7:
            lines.append(BAD[7])
            continue
        if i % 2:
            obj = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "x", "messages": [{"role": "user", "content": f"Tell me about {i} foxes"}],
                            "max_tokens": max_tokens, "temperature": 0}}
        else:
            obj = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                   "body": {"prompt": f"Once upon a time {i}", "max_tokens": max_tokens, "temperature": 0}}
        if i == 20:
            obj["url"] = "/v1/embeddings"
        if i == 33:
            obj["body"]["temperature"] = -1
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")


def check_output(path: Path, n: int = 50) -> list[dict]:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == n, f"{len(recs)} records"
    cids = [r["custom_id"] for r in recs if r["custom_id"] is not None]
    assert len(cids) == len(set(cids)), "duplicate custom_id"
    errors = [r for r in recs if r["error"] is not None]
    assert sorted(r["error"]["line"] for r in errors) == sorted(BAD)
    for r in errors:
        assert f"line {r['error']['line']}" in r["error"]["message"]
    results = [r for r in recs if r["error"] is None]
    assert len(results) == 47
    for r in results:
        assert r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        assert body["object"] in ("chat.completion", "text_completion")
        assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] >= 1
    return recs


async def test_batch_47_results_3_errors(kafka_bootstrap, tiny_model, tokenizer, layout, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    b = busmod.connect(f"kafka://{kafka_bootstrap}")
    await b.start()
    try:
        async with serving(b, tiny_model, layout):
            cfg = BatchConfig(input=inp, output=out, bus_url="", model=tiny_model.name, max_in_flight=16,
                              layout=layout, request_timeout_s=60, progress=False)
            s = await asyncio.wait_for(run_batch(cfg, bus=b, tokenizer=tokenizer), 60)
            assert (s.total, s.results, s.bad_lines, s.failed, s.skipped) == (50, 47, 3, 0, 0)
            check_output(out)
            again = await asyncio.wait_for(run_batch(cfg, bus=b, tokenizer=tokenizer), 30)  # nothing left to do
            assert (again.skipped, again.written) == (50, 0)
            check_output(out)
    finally:
        await b.stop()


def _cmd(kafka: str, model: Path, inp: Path, out: Path, ns: str, in_flight: int) -> list[str]:
    return [sys.executable, "-m", "lockgate.cli", "--log-level", "WARNING", "batch", "run", str(inp),
            "--out", str(out), "--bus", f"kafka://{kafka}", "--model", str(model), "--namespace", ns,
            "--max-in-flight", str(in_flight), "--request-timeout", "60"]


async def test_batch_killed_midway_then_resumed(kafka_bootstrap, tiny_model, layout, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, max_tokens=48)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    b = busmod.connect(f"kafka://{kafka_bootstrap}")
    await b.start()
    try:
        async with serving(b, tiny_model, layout, step_s=0.02):
            cmd = _cmd(kafka_bootstrap, tiny_model, inp, out, layout.namespace, 2)
            with open(tmp_path / "run1.log", "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                try:
                    # 8 results written, or the job ended (reported by the assertion below)
                    await wait_until(lambda: proc.poll() is not None or (out.exists() and out.read_bytes().count(b"\n") >= 8),
                                     timeout=60, interval=0.05)
                    assert proc.poll() is None, "job finished before it could be killed:\n" + (tmp_path / "run1.log").read_text()[-2000:]
                    proc.send_signal(signal.SIGKILL)
                finally:
                    proc.kill()
                    proc.wait(10)
            partial = out.read_bytes().count(b"\n")
            assert 8 <= partial < 50
            with open(out, "ab") as f:  # a write torn by the crash
                f.write(b'{"id": "batch_req_torn", "custom_id": "req-4')
            cmd = _cmd(kafka_bootstrap, tiny_model, inp, out, layout.namespace, 16)  # the rerun may change it
            proc2 = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.PIPE, env=env)
            stdout, stderr = await asyncio.wait_for(proc2.communicate(), 75)
            assert proc2.returncode == 0, stderr.decode()[-3000:]
            summary = json.loads(stdout.decode().strip().splitlines()[-1])
            assert summary["skipped"] == partial and summary["total"] == 50
            assert "50/50" in stderr.decode()  # progress bar reached the end
            check_output(out)
            # the job is complete, every request answered: its reply topic is deleted (Kafka's broker
            # metadata catches up with the controller's delete: bounded wait)
            async def reply_topic_gone() -> bool:
                return await b.list_topics(f"{layout.namespace}.reply.job-") == []

            await wait_until(reply_topic_gone, timeout=15, interval=0.1, message="the job's reply topic deleted")
    finally:
        await b.stop()
