"""Several base models behind one edge over real Kafka (issue 53 part 2, docs/lora.md): workers of
two tiny random models of different families (Llama, Qwen3) share the bus; the edge routes each
request by its ``model`` to that model's topics, lists the models from live heartbeats, loads the
second model's tokenizer on its first request, answers 404 for a name it does not serve and a
prompt 503 (not a hang) for a model whose workers are gone."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from bus import SamplingParams, connect
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.model.test_architectures import variant
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
PROMPT = list(range(30, 60))


def engine(path: str) -> Engine:
    return Engine(EngineConfig(model=path, max_num_seqs=4, num_threads=1, kv_cache_bytes=4 << 20, max_model_len=512))


async def complete(http: aiohttp.ClientSession, url: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json()


async def models(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/v1/models") as r:
        return [m["id"] for m in (await r.json())["data"]]


async def test_two_base_models_behind_one_edge(kafka_bootstrap: str, tiny_model_dir: str, tmp_path: Path) -> None:
    qwen_dir = str(variant("qwen3", tmp_path / "qwen3"))
    engines = {LLAMA: engine(tiny_model_dir), QWEN: engine(qwen_dir)}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = {m: e.generate([PROMPT], params)[0].text for m, e in engines.items()}
    assert want[LLAMA] != want[QWEN]  # the answers tell which model ran
    layout = new_layout(2)
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        cfg = EdgeConfig(model=LLAMA, port=0, openai_port=0, layout=layout, ping_interval_s=None,
                         heartbeat_stale_s=2.0, models=((QWEN, qwen_dir),))
        async with Worker(WorkerConfig(LLAMA, layout=layout, heartbeat_s=0.2), bus, engines[LLAMA]), \
                Edge(cfg, bus, PromptEncoder.from_path(tiny_model_dir)) as edge, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{edge.openai_port}"
            qwen = Worker(WorkerConfig(QWEN, layout=layout, heartbeat_s=0.2), bus, engines[QWEN])
            await qwen.start()
            try:
                async def both_listed() -> bool:
                    return await models(http, url) == [LLAMA, QWEN]

                await wait_until(both_listed, timeout=60)
                assert QWEN not in edge.admission.models.encoders  # its tokenizer: on first use
                for m in (LLAMA, QWEN, LLAMA, QWEN):
                    status, ans = await complete(http, url, m)
                    assert status == 200 and ans["model"] == m and ans["choices"][0]["text"] == want[m], (m, ans)
                assert QWEN in edge.admission.models.encoders
                status, ans = await complete(http, url, "nope")
                assert status == 404 and ans["error"]["code"] == "model_not_found"
            finally:
                await qwen.stop()

            async def qwen_gone() -> bool:
                return await models(http, url) == [LLAMA]

            await wait_until(qwen_gone, timeout=30)
            status, ans = await complete(http, url, QWEN)
            assert status == 503 and "no live worker for tiny-qwen3" in ans["error"]["message"]
            status, ans = await complete(http, url, LLAMA)
            assert status == 200 and ans["choices"][0]["text"] == want[LLAMA]
