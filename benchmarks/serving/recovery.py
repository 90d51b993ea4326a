"""``lockgate bench recovery``: how a client's streams recover when a worker is killed with
``kill -9`` mid-generation, over a real Kafka broker.

Two ``lockgate worker`` processes share one group. Each round publishes ``--requests`` sampled
requests (temperature 0.8, seeded as the edge seeds them) to the model's p1 topic and reads their
reply topic as a client would; once a worker is streaming a request it is killed (SIGKILL; a round
in which every request finished first, or whose victim had finished its streams by the time the kill
landed, is run again, after the victim restarts). For each request that worker had started and
not finished, the recovery time is the gap from the kill to the next token the client receives for it
(from the survivor: its failover detects the silent heartbeats, reads the victim's partitions and
the history, and prefills once; docs/worker.md, "Failover"). Re-run decode steps are the tokens the
survivor generated at a seq the victim had already published (0 when every history was found). The
victim is restarted and the group settles before the next round.

Prints p50/p99/max of the recovery time, the requests taken over and resumed, and the re-run decode
steps, over ``--kills`` rounds. ``--bus`` defaults to Kafka's group defaults (session timeout 10 s):
the takeover does not wait for it. ``--no-failover`` starts the workers without it (the time is then
the session timeout's rebalance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from bus import Finished, InferenceRequest, SamplingParams, TokenChunk, TopicLayout, connect, decode, encode, replies_of

SETTLE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class Fleet:
    """Two worker processes; :meth:`kill` and :meth:`restart` one by name."""

    def __init__(self, args: argparse.Namespace, layout: TopicLayout, model: str, logs: Path) -> None:
        self.args, self.layout, self.model, self.logs = args, layout, model, logs
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.ports: dict[str, int] = {}

    def spawn(self, name: str) -> None:
        port = self.ports.setdefault(name, _free_port())
        a = self.args
        cmd = [str(Path(sys.executable).with_name("lockgate")), "--log-level", "WARNING", "worker", "--bus", a.bus,
               "--model", a.model, "--served-model-name", self.model, "--namespace", self.layout.namespace,
               "--partitions", str(self.layout.partitions), "--worker-id", name, "--max-num-seqs", str(a.max_num_seqs),
               "--kv-cache-bytes", a.kv_cache_bytes, "--metrics-port", str(port)]
        if not a.failover:
            cmd += ["--no-failover"]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        with (self.logs / f"{name}.log").open("a") as err:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)

    async def settled(self) -> None:
        deadline = time.monotonic() + SETTLE_S
        while not all(await asyncio.gather(*(asyncio.to_thread(_ready, p) for p in self.ports.values()))):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready within {SETTLE_S:g}s (logs in {self.logs})")
            await asyncio.sleep(0.2)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


async def _round(bus, fleet: Fleet, layout: TopicLayout, model: str, args: argparse.Namespace, rnd: int,
                 rng: random.Random) -> dict:
    reply = layout.reply_topic(f"recovery-{uuid.uuid4().hex[:8]}")
    await bus.ensure_topics([layout.reply_spec(reply.rsplit(".", 1)[-1], 1)])
    reqs = [InferenceRequest(f"r{rnd}-{i}", model,
                             tuple(rng.randrange(3, 500) for _ in range(args.prompt_tokens or rng.randint(16, 64))),
                             SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True).seeded(),
                             reply, tier=1, enqueued_at=time.time()) for i in range(args.requests)]
    consumer = bus.consumer([reply], start_from="earliest")
    await consumer.start()
    try:
        for r in reqs:
            await bus.send(layout.request_topic(model, 1), encode(r), key=r.request_id.encode())
        chunks: list[tuple[float, TokenChunk]] = []
        finals: dict[str, Finished] = {}
        victim, killed_at = None, 0.0
        deadline = time.monotonic() + 300
        while len(finals) < len(reqs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"round {rnd}: {len(reqs) - len(finals)} requests unanswered after 300 s")
            for rec in await consumer.getmany(timeout_ms=20):
                now = time.monotonic()
                for m in replies_of(decode(rec.value)):
                    if isinstance(m, TokenChunk):
                        chunks.append((now, m))
                    elif isinstance(m, Finished):
                        finals[m.request_id] = m
            if victim is None:
                streaming: dict[str, set[str]] = {}
                for _, c in chunks:
                    if c.request_id not in finals:
                        streaming.setdefault(c.worker_id, set()).add(c.request_id)
                busy = [w for w, rids in streaming.items() if rids]
                if busy:
                    victim, killed_at = busy[0], time.monotonic()
                    fleet.kill(victim)
        # what the victim published (its records still in flight at the kill arrive after it)
        published: dict[str, int] = {}
        for _, c in chunks:
            if c.worker_id == victim:
                published[c.request_id] = max(published.get(c.request_id, 0), c.seq + len(c.token_ids))
        taken = [rid for rid in published if finals[rid].worker_id != victim]
        after = {rid: [(t, c) for t, c in chunks if c.request_id == rid and c.worker_id != victim] for rid in taken}
        recovery = [min(t for t, _ in after[rid]) - killed_at for rid in taken if after[rid]]
        rerun = sum(max(0, published[rid] - min(c.seq for _, c in after[rid])) for rid in taken if after[rid])
        return {"victim": victim, "taken_over": len(taken), "recovery_s": recovery, "rerun_steps": rerun}
    finally:
        await consumer.stop()
        await bus.delete_topics([reply])


async def _bench(args: argparse.Namespace) -> dict:
    from tokenization.model_store import model_name

    model = model_name(args.model)
    layout = TopicLayout(namespace=f"bench-rec-{uuid.uuid4().hex[:8]}", partitions=args.partitions)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    fleet = Fleet(args, layout, model, logs)
    rounds: list[dict] = []
    async with connect(args.bus) as bus:
        await bus.ensure_topics(layout.model_specs(model))
        try:
            for name in ("wa", "wb"):
                fleet.spawn(name)
            await fleet.settled()
            k = misses = 0
            while k < args.kills:
                r = await _round(bus, fleet, layout, model, args, len(rounds) + misses, rng)
                # a miss: every request finished before a worker was caught streaming, or the one
                # caught had finished its last stream by the time the kill landed (nothing to take over)
                if r["victim"] is None or not r["taken_over"]:
                    misses += 1
                    if r["victim"] is not None:
                        fleet.spawn(r["victim"])
                        await fleet.settled()
                    if misses > args.kills:
                        raise RuntimeError("no round caught a worker streaming: raise --max-tokens")
                    continue
                rounds.append(r)
                print(f"kill {k + 1}/{args.kills}: {r['victim']} killed, {r['taken_over']} taken over, recovery "
                      + ", ".join(f"{x:.2f}" for x in r["recovery_s"]) + f" s, re-run steps {r['rerun_steps']}",
                      file=sys.stderr, flush=True)
                fleet.spawn(r["victim"])
                await fleet.settled()
                k += 1
        finally:
            fleet.stop()
            await bus.delete_topics(layout.request_topics(model))
    times = sorted(x for r in rounds for x in r["recovery_s"])

    def pct(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))] if times else float("nan")

    return {"kills": len(rounds), "taken_over": sum(r["taken_over"] for r in rounds), "samples": len(times),
            "recovery_p50_s": pct(0.5), "recovery_p99_s": pct(0.99), "recovery_max_s": times[-1] if times else None,
            "recovery_mean_s": statistics.fmean(times) if times else None,
            "rerun_steps": sum(r["rerun_steps"] for r in rounds), "rounds": rounds}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bus", default="kafka://127.0.0.1:9092",
                   help="a Kafka bus URL (the group's defaults: session timeout 10 s)")
    p.add_argument("--failover", action=argparse.BooleanOptionalAction, default=True,
                   help="the workers' heartbeat failover (off: recovery waits for the group's rebalance)")
    p.add_argument("--model", default="default", help="model of both workers (folder, hub id or default)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--requests", type=int, default=6, help="sampled requests per round")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompt length of every request (0: 16-64 at random): the takeover re-prefills it")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-bytes", default="256M")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="bench-recovery-logs", help="folder for the workers' stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.kills < 1 or args.requests < 2:
        raise ValueError("--kills must be >= 1 and --requests >= 2")
    if args.prompt_tokens < 0:
        raise ValueError(f"--prompt-tokens must be >= 0, got {args.prompt_tokens}")
    res = asyncio.run(_bench(args))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"lockgate bench recovery --kills {args.kills} --requests {args.requests} --max-tokens {args.max_tokens} "
          f"--model {args.model} --prompt-tokens {args.prompt_tokens} --bus {args.bus}" + ("" if args.failover else " --no-failover"))
    print(f"  kills {res['kills']}, requests taken over {res['taken_over']}, re-run decode steps {res['rerun_steps']}")
    print(f"  kill -> next token on the client: p50 {res['recovery_p50_s']:.2f} s, p99 {res['recovery_p99_s']:.2f} s, "
          f"max {res['recovery_max_s']:.2f} s ({res['samples']} samples)")
    return 0
