"""Tenants never share prefix-cache entries: the edge salts every request's cache with its tenant,
so ``cached_tokens`` never tells one tenant that another sent the same prefix (memory bus, real
worker on the tiny model)."""

from __future__ import annotations

from pathlib import Path

from bus import MemoryBus
from edge.config import EdgeConfig, KeyEntry, hash_key
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.edge.conftest import client, collect, recv, send, wait_for
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixture, used by name

PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # several KV blocks of shared prefix


async def test_a_prefix_is_cached_per_tenant(tiny_dir: Path) -> None:
    ka, kb = "key-tenant-a", "key-tenant-b"
    keys = {e.key_hash: e for e in (KeyEntry(hash_key(ka), "acme", 1), KeyEntry(hash_key(kb), "globex", 1))}
    engine = make_engine(tiny_dir)
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, heartbeat_s=0.1), bus, engine):
        config = EdgeConfig(model=MODEL, port=0, keys=keys, ping_interval_s=None)
        async with Edge(config, bus, PromptEncoder.from_path(str(tiny_dir))) as edge:
            await wait_for(lambda: edge.readiness()[0])

            async def cached(key: str, cid: str) -> int:
                async with client(edge, key) as ws:
                    await send(ws, {"type": "generate", "id": cid, "prompt": PROMPT, "max_tokens": 2,
                                    "temperature": 0})
                    await recv(ws)  # accepted
                    _, _, done = await collect(ws, cid)
                    assert done["type"] == "done", done
                    return int(done["usage"]["cached_tokens"])

            assert await cached(ka, "a1") == 0  # cold
            assert await cached(kb, "b1") == 0  # the same prompt, another tenant: not a hit
            assert await cached(ka, "a2") > 0  # the first tenant's repeat hits its own cache
            assert await cached(kb, "b2") > 0


async def test_a_request_cache_salt_separates_prefixes_within_a_tenant(tiny_dir: Path) -> None:
    """vLLM's ``cache_salt``: requests of one tenant share cached prefixes only with the same salt."""
    engine = make_engine(tiny_dir)
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, heartbeat_s=0.1), bus, engine):
        config = EdgeConfig(model=MODEL, port=0, ping_interval_s=None)  # dev mode: one tenant
        async with Edge(config, bus, PromptEncoder.from_path(str(tiny_dir))) as edge:
            await wait_for(lambda: edge.readiness()[0])

            async def cached(cid: str, salt: str | None) -> int:
                async with client(edge, None) as ws:
                    frame = {"type": "generate", "id": cid, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
                    if salt is not None:
                        frame["cache_salt"] = salt
                    await send(ws, frame)
                    await recv(ws)
                    _, _, done = await collect(ws, cid)
                    return int(done["usage"]["cached_tokens"])

            assert await cached("s1", "alice") == 0
            assert await cached("s2", "bob") == 0  # another salt: not a hit
            assert await cached("s3", None) == 0  # no salt: the tenant's shared namespace, cold
            assert await cached("s4", "alice") > 0
            assert await cached("s5", None) > 0
