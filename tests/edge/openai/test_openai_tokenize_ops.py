"""/tokenize, /detokenize and the probes on the OpenAI API's port (raw HTTP: the SDK has no client
for them): memory bus, fake worker."""

from __future__ import annotations

import aiohttp

from bus import ChatMessage
from tests.edge.conftest import KEY, MODEL, running_edge
from tests.waiting import wait_until

AUTH = {"Authorization": f"Bearer {KEY}"}


def root(edge) -> str:
    return f"http://127.0.0.1:{edge.openai_port}"


async def test_tokenize_prompt_and_chat_and_detokenize_round_trip(encoder):
    async with running_edge(encoder, openai_port=0) as (edge, _), aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{root(edge)}/tokenize", json={"model": MODEL, "prompt": "Once upon a time",
                                                              "return_token_strs": True}) as r:
            assert r.status == 200
            out = await r.json()
        want = encoder.text_ids("Once upon a time")
        assert out["tokens"] == want and out["count"] == len(want)
        assert out["max_model_len"] == encoder.context_len
        assert out["token_strs"] == encoder.tokenizer.convert_ids_to_tokens(want)

        msgs = [{"role": "user", "content": "hello there"}]
        async with http.post(f"{root(edge)}/tokenize", json={"messages": msgs}) as r:  # model optional
            chat = await r.json()
        assert chat["tokens"] == encoder.chat_ids([ChatMessage("user", "hello there")])
        assert chat["token_strs"] is None
        async with http.post(f"{root(edge)}/tokenize",
                             json={"messages": msgs, "add_generation_prompt": False}) as r:
            bare = await r.json()
        assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]

        async with http.post(f"{root(edge)}/detokenize", json={"model": MODEL, "tokens": want}) as r:
            assert r.status == 200
            assert (await r.json())["prompt"] == encoder.tokenizer.decode(want)


async def test_tokenize_bad_input_is_a_400_naming_the_field(encoder):
    async with running_edge(encoder, openai_port=0) as (edge, _), aiohttp.ClientSession(headers=AUTH) as http:
        cases = [("/tokenize", {"prompt": 5}, "prompt"),
                 ("/tokenize", {}, "prompt"),
                 ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
                 ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                 ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                 ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
                 ("/detokenize", {"tokens": [len(encoder.tokenizer)]}, "tokens"),
                 ("/detokenize", {"tokens": [-1]}, "tokens")]
        for path, body, field in cases:
            async with http.post(f"{root(edge)}{path}", json=body) as r:
                assert r.status == 400, (path, body)
                err = (await r.json())["error"]
                assert err["param"] == field and err["type"] == "invalid_request_error", (body, err)
        async with http.post(f"{root(edge)}/tokenize", json={"model": "gpt-4o", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with http.post(f"{root(edge)}/tokenize", data=b"{not json") as r:
            assert r.status == 400
        async with aiohttp.ClientSession() as anon, anon.post(f"{root(edge)}/tokenize", json={"prompt": "x"}) as r:
            assert r.status == 401
        async with http.post(f"{root(edge)}/tokenize", json={"prompt": "still serving"}) as r:
            assert r.status == 200


async def test_probes_metrics_and_version_on_the_api_port(encoder):
    async with running_edge(encoder, openai_port=0) as (edge, _), aiohttp.ClientSession() as http:
        async with http.get(f"{root(edge)}/health") as r:
            assert r.status == 200
        async with http.get(f"{root(edge)}/ready") as r:
            assert r.status == 200 and (await r.text()).startswith("ready: ")
        async with http.get(f"{root(edge)}/version") as r:
            assert r.status == 200 and isinstance((await r.json())["version"], str)
        async with http.post(f"{root(edge)}/tokenize", json={"prompt": "x"}, headers=AUTH) as r:
            assert r.status == 200
        async with http.post(f"{root(edge)}/tokenize", json={"prompt": 1}, headers=AUTH) as r:
            assert r.status == 400
        async with http.get(f"{root(edge)}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        # the same registry as the WebSocket port's: the 400 above is counted there
        assert 'lockgate:edge_rejections_total{api="openai",reason="invalid_request"}' in text
    async with running_edge(encoder, openai_port=0, worker=False) as (edge, _), aiohttp.ClientSession() as http:
        async with http.get(f"{root(edge)}/ready") as r:
            assert r.status == 503 and (await r.text()).startswith("not ready: ")
        async with http.get(f"{root(edge)}/health") as r:
            assert r.status == 200


async def test_ready_follows_the_worker(encoder):
    async with running_edge(encoder, openai_port=0, heartbeat_stale_s=0.5) as (edge, fw), \
            aiohttp.ClientSession() as http:
        async def status() -> int:
            async with http.get(f"{root(edge)}/ready") as r:
                return r.status

        assert await status() == 200
        await fw.stop()

        async def not_ready() -> bool:
            return await status() == 503

        await wait_until(not_ready, timeout=10, message="/ready still 200 after the worker stopped")
