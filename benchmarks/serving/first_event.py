"""When the first streamed event of a chat completion arrives, against the first token.

``vllm bench serve`` and genai-perf read TTFT at the first streamed chunk; this times, on the raw
SSE stream of a running OpenAI-compatible server, the first event (whatever it carries) and the
first event with content, for long prompts that make prefill visible. The ratio first event /
first token is 1.0 for a server that sends nothing before its first token (issue #47's bar: >= 0.8).

    python -m benchmarks.serving.first_event --url http://127.0.0.1:8000/v1 --words 1500 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import orjson

from benchmarks.serving.loadgen import synthetic_text


def prompt_of(words: int, salt: int) -> str:
    """``words`` words, different for each ``salt`` (no prefix-cache hit between repeats)."""
    return "Summarise this text: " + synthetic_text(words, 1000 + salt)


async def one(url: str, model: str, key: str, words: int, salt: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt_of(words, salt)}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    first_event = first_token = None
    async with aiohttp.ClientSession() as h:
        sent = time.monotonic()
        async with h.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                now = time.monotonic()
                first_event = first_event or now
                ev = orjson.loads(line[6:])
                if first_token is None and any(c.get("delta", {}).get("content") for c in ev.get("choices", ())):
                    first_token = now
    if first_event is None or first_token is None:
        raise RuntimeError("the stream ended without a content token")
    return {"first_event_ms": round((first_event - sent) * 1000, 1), "first_token_ms": round((first_token - sent) * 1000, 1),
            "ratio": round((first_event - sent) / (first_token - sent), 3)}


async def run(args: argparse.Namespace) -> list[dict]:
    out = []
    for i in range(args.repeat):
        out.append(await one(args.url, args.model, args.api_key, args.words, i, args.max_tokens))
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default="none")
    p.add_argument("--words", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    results = asyncio.run(run(p.parse_args()))
    print(json.dumps({"min_ratio": min(r["ratio"] for r in results)}))


if __name__ == "__main__":
    main()
