"""``lockgate bench edge-resume``: what it costs a client when its edge dies, and what the shared
state costs an edge, over a real Kafka broker (issue #51).

One ``lockgate worker`` and two ``lockgate edge`` processes share a fresh namespace. Each round
starts a background, streamed response (``/v1/responses``, greedy, ``--max-tokens``) on one edge;
once the client has read ``--kill-after`` text deltas that edge is killed (SIGKILL) and the client at
once resumes with ``GET /v1/responses/{id}?stream=true&starting_after=N`` on the other edge. The
figure is the time from the kill to the first event the client receives after reconnecting
(p50/p99 over ``--kills`` rounds); every resumed response's text is checked against the round's
undisturbed reference. The killed edge is restarted (cold) before the next round, and the roles
alternate.

The edge's added cost for the shared state: the latency of ``--requests`` non-streamed one-token
responses with ``store: true`` (a record written at admission, concurrently with the publish, and
again at the end, both on the bus table) against ``store: false`` (neither), interleaved, p50 each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bus import TopicLayout, connect

READY_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class Procs:
    """The worker and edge processes; edges by name, each with its OpenAI port."""

    def __init__(self, args: argparse.Namespace, layout: TopicLayout, model: str, logs: Path) -> None:
        self.args, self.layout, self.model, self.logs = args, layout, model, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.exe = str(Path(sys.executable).with_name("lockgate"))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with (self.logs / f"{name}.log").open("a") as err:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)

    def worker(self) -> None:
        a = self.args
        self.ports["worker"] = _free_port()
        self._spawn("worker", [self.exe, "--log-level", "WARNING", "worker", "--bus", a.bus, "--model", a.model,
                               "--served-model-name", self.model, "--namespace", self.layout.namespace,
                               "--partitions", str(self.layout.partitions), "--worker-id", "w1",
                               "--max-num-seqs", "4", "--metrics-port", str(self.ports["worker"]),
                               "--threads", str(a.threads)])

    def edge(self, name: str) -> None:
        a = self.args
        self.ports[name] = _free_port()
        self._spawn(name, [self.exe, "--log-level", "WARNING", "edge", "--bus", a.bus, "--model", a.model,
                           "--namespace", self.layout.namespace, "--partitions", str(self.layout.partitions),
                           "--port", str(_free_port()), "--openai-port", str(self.ports[name]), "--edge-id", name])

    async def ready(self, *names: str) -> None:
        deadline = time.monotonic() + READY_S
        for n in names:
            path = "/readyz" if n == "worker" else "/ready"
            while not await asyncio.to_thread(_ready, f"http://127.0.0.1:{self.ports[n]}{path}"):
                if self.procs[n].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{n} not ready (logs in {self.logs})")
                await asyncio.sleep(0.2)

    def kill(self, name: str) -> float:
        """SIGKILL ``name``; the time of the kill (``time.perf_counter``)."""
        p = self.procs.pop(name)
        p.kill()
        t = time.perf_counter()
        p.wait(10)
        return t

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait(10)


def _client(port: int) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="dev", max_retries=0, timeout=120)


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def _round(procs: Procs, victim: str, rescuer: str, body: dict[str, Any], want: str, kill_after: int) -> float:
    async with _client(procs.ports[victim]) as cv, _client(procs.ports[rescuer]) as cr:
        stream = await cv.responses.create(**body, stream=True, background=True)
        before: list[Any] = []
        async for e in stream:
            before.append(e)
            if sum(x.type == "response.output_text.delta" for x in before) >= kill_after:
                break
        else:
            raise RuntimeError("the response ended before the kill: raise --max-tokens")
        t_kill = procs.kill(victim)
        after = await cr.responses.retrieve(before[0].response.id, stream=True,
                                            starting_after=before[-1].sequence_number)
        first: float | None = None
        events: list[Any] = []
        async for e in after:
            if first is None:
                first = time.perf_counter()
            events.append(e)
    if _text(before + events) != want:
        raise RuntimeError("a resumed response differs from the undisturbed run")
    assert first is not None
    return first - t_kill


async def _store_cost(port: int, model: str, n: int) -> dict[str, float]:
    lat: dict[bool, list[float]] = {True: [], False: []}
    async with _client(port) as c:
        for i in range(2 * n):
            store = i % 2 == 0
            t = time.perf_counter()
            await c.responses.create(model=model, input=f"cost probe {i}", max_output_tokens=1, store=store,
                                     temperature=0.0)
            lat[store].append(time.perf_counter() - t)
    p50 = {k: statistics.median(v) for k, v in lat.items()}
    return {"store_p50_ms": p50[True] * 1000, "no_store_p50_ms": p50[False] * 1000,
            "added_ms": (p50[True] - p50[False]) * 1000}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenization.model_store import model_name

    model = model_name(args.model)
    layout = TopicLayout(namespace=f"bench-resume-{uuid.uuid4().hex[:8]}", partitions=2)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs = Procs(args, layout, model, logs)
    body = {"model": model, "input": "Tell me a long story about a lighthouse keeper.",
            "max_output_tokens": args.max_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    times: list[float] = []
    async with connect(args.bus) as bus:
        await bus.ensure_topics(layout.model_specs(model))
        try:
            procs.worker()
            procs.edge("ea")
            procs.edge("eb")
            await procs.ready("worker", "ea", "eb")
            async with _client(procs.ports["eb"]) as c:
                want = _text([e async for e in await c.responses.create(**body, stream=True, background=True)])
            cost = await _store_cost(procs.ports["eb"], model, args.requests)
            victim, rescuer = "ea", "eb"
            for k in range(args.kills):
                dt = await _round(procs, victim, rescuer, body, want, args.kill_after)
                times.append(dt)
                print(f"kill {k + 1}/{args.kills}: {victim} killed, next event on {rescuer} after {dt * 1000:.0f} ms",
                      file=sys.stderr, flush=True)
                procs.edge(victim)  # restarted cold
                await procs.ready(victim)
                victim, rescuer = rescuer, victim
        finally:
            procs.stop()
            await bus.delete_topics([*layout.request_topics(model), layout.table_topic("edge"),
                                     layout.reply_topic("ea"), layout.reply_topic("eb")])
    times.sort()

    def pct(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))]

    return {"kills": len(times), "resume_p50_s": pct(0.5), "resume_p99_s": pct(0.99), "resume_max_s": times[-1],
            **cost}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bus", default="kafka://127.0.0.1:9092", help="a Kafka bus URL")
    p.add_argument("--model", default="default", help="model of the worker and the edges (folder, hub id or default)")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=3, help="text deltas the client reads before the kill")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=50, help="requests of each kind for the store's cost")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--logs", default="bench-edge-resume-logs", help="folder for the processes' stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.kills < 1 or args.requests < 1 or args.kill_after < 1:
        raise ValueError("--kills, --requests and --kill-after must be >= 1")
    res = asyncio.run(_bench(args))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"lockgate bench edge-resume --kills {args.kills} --max-tokens {args.max_tokens} --model {args.model}")
    print(f"  edge kill -> next event after the resume on another edge: p50 {res['resume_p50_s'] * 1000:.0f} ms, "
          f"p99 {res['resume_p99_s'] * 1000:.0f} ms, max {res['resume_max_s'] * 1000:.0f} ms ({res['kills']} kills)")
    print(f"  one-token response, p50: store true {res['store_p50_ms']:.1f} ms, store false "
          f"{res['no_store_p50_ms']:.1f} ms: the shared state adds {res['added_ms']:.1f} ms")
    return 0
