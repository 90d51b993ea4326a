"""`lockgate serve` with the Files and Batches API: the flags (``--max-file-bytes``,
``--batch-max-in-flight``, their env twins, EdgeConfig's defaults) reach the edge, and an
embeddings batch runs on the embedded real worker through the ``openai`` SDK, each vector the one
the live endpoint gives."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket

import openai
import pytest

from edge.config import EdgeConfig
from lockgate import serve
from lockgate.commands import edge
from lockgate.openai_options import batch_options
from lockgate.serve import run_embedded
from tokenization.model_store import model_name


def _parse(module, command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers(), None)
    return parser.parse_args([command, *argv])


@pytest.mark.parametrize(("module", "command"), [(edge, "edge"), (serve, "serve")])
def test_batch_flags_reach_the_config_with_env_twins_and_defaults(module, command: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    got = EdgeConfig(model="m", **batch_options(_parse(module, command, ["--max-file-bytes", "1000",
                                                                         "--batch-max-in-flight", "3"])))
    assert (got.max_file_bytes, got.batch_max_in_flight) == (1000, 3)
    ref = EdgeConfig(model="m")
    dflt = EdgeConfig(model="m", **batch_options(_parse(module, command, [])))
    assert (dflt.max_file_bytes, dflt.batch_max_in_flight) == (ref.max_file_bytes, ref.batch_max_in_flight)
    monkeypatch.setenv("LOCKGATE_MAX_FILE_BYTES", "77")
    monkeypatch.setenv("LOCKGATE_BATCH_MAX_IN_FLIGHT", "5")
    env = batch_options(_parse(module, command, []))
    assert env == {"max_file_bytes": 77, "batch_max_in_flight": 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
async def test_an_embeddings_batch_on_lockgate_serve(tiny_model_dir: str) -> None:
    port = _free_port()
    args = _parse(serve, "serve", ["--model", tiny_model_dir, "--port", "0", "--openai-port", str(port),
                                   "--kv-cache-bytes", "8M", "--bus", "memory://serve-batches-test",
                                   "--batch-max-in-flight", "2"])
    ready, stop = asyncio.get_running_loop().create_future(), asyncio.Event()
    task = asyncio.create_task(run_embedded(args, ready, stop, freeze=False))
    try:
        await asyncio.wait_for(ready, 60)
        model = model_name(tiny_model_dir)
        texts = ["first input", "a second, longer input to embed", "third"]
        lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": model, "input": t}} for i, t in enumerate(texts)]
        lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": model, "input": "x", "dimensions": 8}})
        data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="dev", max_retries=0,
                                      timeout=60) as client:
            f = await client.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
            b = await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
            for _ in range(600):
                b = await client.batches.retrieve(b.id)
                if b.status in ("completed", "failed"):
                    break
                await asyncio.sleep(0.1)
            assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 1)
            out = [json.loads(x) for x in (await client.files.content(b.output_file_id)).content.splitlines()]
            for r in out:
                got = openai.types.CreateEmbeddingResponse.model_validate(r["response"]["body"])
                live = await client.embeddings.create(model=model, input=texts[int(r["custom_id"][1:])])
                assert got.data[0].embedding == pytest.approx(live.data[0].embedding, abs=1e-5)
            (err,) = [json.loads(x) for x in (await client.files.content(b.error_file_id)).content.splitlines()]
            assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
            assert err["response"]["body"]["error"]["param"] == "dimensions"
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
