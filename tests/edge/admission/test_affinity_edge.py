"""The edge publishes by prefix affinity and carries the key's weight (edge/admission/affinity.py, end to end)."""

from __future__ import annotations

from bus import InferenceRequest, decode
from edge.admission.affinity import prefix_key
from tests.edge.conftest import KEY, client, collect, keys, recv, running_edge, send


def _chat(cid: str, system: str, user: str) -> dict:
    return {"type": "generate", "id": cid, "max_tokens": 3,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


async def test_same_system_prompt_same_partition_and_the_weight_travels(encoder) -> None:
    async with running_edge(encoder, keys=keys(weight=2.5)) as (edge, fw):
        async with client(edge, KEY) as ws:
            for i, (system, user) in enumerate([("You are terse.", "hi"), ("You are terse.", "what is 2+2?"),
                                                ("You are a pirate.", "hi")]):
                await send(ws, _chat(f"c{i}", system, user))
                assert (await recv(ws))["type"] == "accepted"
                await collect(ws, f"c{i}")
        topic = edge.config.layout.request_topic(edge.config.model, 1)
        c = edge.bus.consumer([topic], start_from="earliest")
        await c.start()
        placed: dict[tuple[str, str], tuple[int, bytes | None, InferenceRequest]] = {}
        while len(placed) < 3:
            for rec in await c.getmany(timeout_ms=200):
                req = decode(rec.value)
                assert isinstance(req, InferenceRequest) and req.messages is not None
                placed[(req.messages[0].content, req.messages[1].content)] = (rec.partition, rec.key, req)
        await c.stop()
        p_a, k_a, r_a = placed[("You are terse.", "hi")]
        p_b, k_b, _ = placed[("You are terse.", "what is 2+2?")]
        _, k_c, _ = placed[("You are a pirate.", "hi")]
        assert k_a == k_b == prefix_key("acme", r_a.prompt_token_ids, r_a.messages) and p_a == p_b
        assert k_c != k_a
        assert all(r.weight == 2.5 and r.tenant == "acme" for _, _, r in placed.values())
        assert len(fw.seen) == 3  # type: ignore[union-attr]
