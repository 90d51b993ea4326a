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

``--signal stop``: the victim is paused (SIGSTOP) instead, and continued (SIGCONT) once every stream
it had in hand got its next token from the survivor (at most ``--pause`` seconds); it is not
restarted. The survivor takes its streams over with a higher attempt; what the paused worker still
sends when it continues must be dropped by the edge (fenced), so the client sees no token twice.

Every round's replies are replayed, in topic order, through the edge's own rules (fencing by
attempt, ``edge.admission.router.dedupe``): the stream each client would have received. Gaps
(a chunk past the next expected seq), splices refused and fenced replies are counted, and
(``--exact``, the default) every taken-over stream is compared with a local reference run of the
same request (same model, seed, threads): byte-exact or not.

Prints p50/p99/max of the recovery time, the requests taken over and resumed, the re-run decode
steps and the checks above, over ``--kills`` rounds. ``--bus`` defaults to Kafka's group defaults
(session timeout 10 s): the takeover does not wait for it. ``--no-failover`` starts the workers
without it (the time is then the session timeout's rebalance).
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

from bus import (
    Error,
    Finished,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    TopicLayout,
    connect,
    decode,
    encode,
    replies_of,
)
from edge.admission.router import SpliceMismatch, dedupe

SETTLE_S = 180.0  # worker start-up and the group settling; long on a loaded machine
ROUND_S = 300.0  # a round's bound: its requests answered and every stream ended


class EdgeView:
    """One stream as the edge delivers it (``edge.admission.router.ReplyRouter``): replies of an
    attempt below the highest seen are dropped (fenced), chunks deduped by seq, the first final
    reply of a live attempt ends it. A chunk starting past the next expected seq is a gap."""

    def __init__(self) -> None:
        self.next_seq = self.chars = self.attempt = self.fenced = self.gaps = 0
        self.delivered: list[int] = []
        self.spliced = False
        self.final: Finished | Error | None = None

    def take(self, msg: TokenChunk | Finished | Error) -> None:
        if self.final is not None or self.spliced:
            return
        if msg.attempt < self.attempt:
            self.fenced += 1
            return
        self.attempt = msg.attempt
        if isinstance(msg, TokenChunk):
            self.gaps += msg.seq > self.next_seq
            try:
                dedupe(self, msg)  # type: ignore[arg-type]  # duck-typed Stream: next_seq, chars, delivered
            except SpliceMismatch:
                self.spliced = True
        else:
            self.final = msg


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

    def pause(self, name: str, on: bool) -> None:
        self.procs[name].send_signal(signal.SIGSTOP if on else signal.SIGCONT)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


async def _round(bus, fleet: Fleet, layout: TopicLayout, model: str, args: argparse.Namespace, rnd: int,
                 rng: random.Random, reply: str) -> dict:
    reqs = [InferenceRequest(f"r{rnd}-{i}", model,
                             tuple(rng.randrange(3, 500) for _ in range(args.prompt_tokens or rng.randint(16, 64))),
                             SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True).seeded(),
                             reply, tier=1, enqueued_at=time.time()) for i in range(args.requests)]
    consumer = bus.consumer([reply], start_from="earliest")
    await consumer.start()
    stopped = False
    try:
        for r in reqs:
            await bus.send(layout.request_topic(model, 1), encode(r), key=r.request_id.encode())
        events: list[tuple[float, TokenChunk | Finished | Error]] = []  # every reply, in topic order
        views = {r.request_id: EdgeView() for r in reqs}
        victim, hit_at, at = None, 0.0, ""
        deadline = time.monotonic() + ROUND_S
        while not all(v.final is not None or v.spliced for v in views.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"round {rnd}: streams not ended after {ROUND_S:g} s")
            for rec in await consumer.getmany(timeout_ms=20):
                now = time.monotonic()
                for m in replies_of(decode(rec.value)):
                    if isinstance(m, (TokenChunk, Finished, Error)) and m.request_id in views:
                        events.append((now, m))
                        views[m.request_id].take(m)
            if victim is None:
                streaming = _in_hand(events, None)
                if streaming:
                    victim, hit_at, at = next(iter(streaming.values())), time.monotonic(), time.strftime("%H:%M:%S")
                    if args.signal == "kill":
                        fleet.kill(victim)
                    else:
                        fleet.pause(victim, True)
                        stopped = True
            elif stopped and (time.monotonic() - hit_at > args.pause or _taken_over(events, victim)):
                fleet.pause(victim, False)
                stopped = False
        hand = _in_hand(events, victim) if victim is not None else {}
        taken = [rid for rid in hand if (f := views[rid].final) is not None and f.worker_id != victim]
        # what the victim published before the survivor's first reply (its records in flight at the
        # signal arrive after it; a paused victim's late replies, fenced, come after the survivor's)
        after = {rid: [(t, m) for t, m in events if m.request_id == rid and m.worker_id != victim] for rid in taken}
        recovery = [min(t for t, _ in after[rid]) - hit_at for rid in taken if after[rid]]
        rerun = 0
        for rid in taken:
            published, first = 0, None  # the victim's tokens before the taker's first chunk; that chunk
            for _, m in events:
                if m.request_id != rid or not isinstance(m, TokenChunk):
                    continue
                if m.worker_id != victim:
                    first = m
                    break
                published = max(published, m.seq + len(m.token_ids))
            if first is not None:
                rerun += max(0, published - first.seq)
        return {"victim": victim, "at": at, "taken_over": len(taken), "recovery_s": recovery, "rerun_steps": rerun,
                "gaps": sum(v.gaps for v in views.values()), "spliced": sum(v.spliced for v in views.values()),
                "fenced": sum(v.fenced for v in views.values()),
                "streams": {rid: (r, list(views[rid].delivered), views[rid].final) for r in reqs
                            if (rid := r.request_id) in taken}}
    finally:
        if stopped and victim is not None:
            fleet.pause(victim, False)
        await consumer.stop()


def _in_hand(events: list[tuple[float, TokenChunk | Finished | Error]], worker: str | None) -> dict[str, str]:
    """The requests streamed and not finished (request id -> the worker streaming it), in topic
    order. With ``worker``: the ones it streamed and had not finished itself when another worker's
    first reply for them came (a takeover: they stay in hand)."""
    out: dict[str, str] = {}
    closed: set[str] = set()
    for _, m in events:
        rid = m.request_id
        if rid in closed:
            continue
        if worker is not None and m.worker_id != worker:
            if rid in out:
                closed.add(rid)
            continue
        if isinstance(m, TokenChunk):
            out[rid] = m.worker_id
        else:
            out.pop(rid, None)
            closed.add(rid)
    return out


def _taken_over(events: list[tuple[float, TokenChunk | Finished | Error]], victim: str) -> bool:
    """Every stream ``victim`` had in hand has a reply from another worker."""
    hand = _in_hand(events, victim)
    answered = {m.request_id for _, m in events if m.worker_id not in ("", victim)}
    return hand.keys() <= answered


def _exact(args: argparse.Namespace, streams: list[tuple[InferenceRequest, list[int], Finished | Error | None]]
           ) -> list[str]:
    """The streams of ``streams`` (request, tokens the client got, its final reply) that differ from
    a local reference run of the request (same model, seed and threads; full length, final reply
    included), each with how."""
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from tokenization.model_store import resolve_model

    if not streams:
        return []
    engine = Engine(EngineConfig(model=str(resolve_model(args.model)), max_num_seqs=args.max_num_seqs,
                                 num_threads=args.threads or 1, kv_cache_bytes=_bytes(args.kv_cache_bytes)))
    ref = engine.generate([r.prompt_token_ids for r, _, _ in streams], [r.sampling for r, _, _ in streams])
    bad = []
    for (r, got, fin), out in zip(streams, ref):
        want = list(out.token_ids)
        if want != got or not isinstance(fin, Finished) or fin.num_tokens != len(got):
            first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            bad.append(f"{r.request_id}: got {len(got)} tokens, want {len(want)}, first difference at {first}, "
                       f"final {type(fin).__name__} {getattr(fin, 'worker_id', '')} attempt {getattr(fin, 'attempt', '')}")
    return bad


def _bytes(text: str) -> int:
    """``256M`` and the like (the worker's ``--kv-cache-bytes``)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(float(text.rstrip("KMG")) * scale)
    except ValueError:
        raise ValueError(f"--kv-cache-bytes: not a size: {text!r}") from None


async def _bench(args: argparse.Namespace) -> dict:
    from tokenization.model_store import model_name

    model = model_name(args.model)
    layout = TopicLayout(namespace=f"bench-rec-{uuid.uuid4().hex[:8]}", partitions=args.partitions)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    fleet = Fleet(args, layout, model, logs)
    rounds: list[dict] = []
    # One reply topic for the whole run, deleted at the end: the group re-delivers a dead worker's
    # uncommitted requests of earlier rounds after its rebalance, and they must find their final
    # replies (committed without running), not a deleted topic (run again, then dead-lettered).
    reply = layout.reply_topic("recovery")
    async with connect(args.bus) as bus:
        await bus.ensure_topics(layout.model_specs(model) + [layout.reply_spec("recovery", 1)])
        try:
            for name in ("wa", "wb"):
                fleet.spawn(name)
            await fleet.settled()
            k = misses = 0
            while k < args.kills:
                r = await _round(bus, fleet, layout, model, args, len(rounds) + misses, rng, reply)
                # a miss: every request finished before a worker was caught streaming, or the one
                # caught had finished its last stream by the time the kill landed (nothing to take over)
                if r["victim"] is None or not r["taken_over"]:
                    misses += 1
                    if r["victim"] is not None:
                        if args.signal == "kill":
                            fleet.spawn(r["victim"])
                        await fleet.settled()
                    if misses > args.kills:
                        raise RuntimeError("no round caught a worker streaming: raise --max-tokens")
                    continue
                rounds.append(r)
                print(f"{args.signal} {k + 1}/{args.kills} at {r['at']}: {r['victim']} "
                      f"{'killed' if args.signal == 'kill' else 'paused'}, "
                      f"{r['taken_over']} taken over, recovery " + ", ".join(f"{x:.2f}" for x in r["recovery_s"])
                      + f" s, re-run steps {r['rerun_steps']}, fenced replies {r['fenced']}, gaps {r['gaps']}",
                      file=sys.stderr, flush=True)
                if args.signal == "kill":
                    fleet.spawn(r["victim"])
                await fleet.settled()
                k += 1
        finally:
            fleet.stop()
            await bus.delete_topics(layout.request_topics(model) + [reply])
    streams = [st for r in rounds for st in r.pop("streams").values()]
    inexact = await asyncio.to_thread(_exact, args, streams) if args.exact else None
    exact = None if inexact is None else len(streams) - len(inexact)
    times = sorted(x for r in rounds for x in r["recovery_s"])

    def pct(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))] if times else float("nan")

    return {"kills": len(rounds), "taken_over": sum(r["taken_over"] for r in rounds), "samples": len(times),
            "recovery_p50_s": pct(0.5), "recovery_p99_s": pct(0.99), "recovery_max_s": times[-1] if times else None,
            "recovery_mean_s": statistics.fmean(times) if times else None,
            "rerun_steps": sum(r["rerun_steps"] for r in rounds), "gaps": sum(r["gaps"] for r in rounds),
            "spliced": sum(r["spliced"] for r in rounds), "fenced": sum(r["fenced"] for r in rounds),
            "exact": exact, "exact_of": len(streams), "inexact": inexact, "rounds": rounds}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bus", default="kafka://127.0.0.1:9092",
                   help="a Kafka bus URL (the group's defaults: session timeout 10 s)")
    p.add_argument("--failover", action=argparse.BooleanOptionalAction, default=True,
                   help="the workers' heartbeat failover (off: recovery waits for the group's rebalance)")
    p.add_argument("--model", default="default", help="model of both workers (folder, hub id or default)")
    p.add_argument("--kills", type=int, default=20, help="rounds, each with one worker killed (or paused)")
    p.add_argument("--signal", choices=("kill", "stop"), default="kill",
                   help="kill: SIGKILL the victim (restarted after the round); stop: SIGSTOP it, SIGCONT once "
                        "its streams were taken over")
    p.add_argument("--pause", type=float, default=5.0,
                   help="--signal stop: the longest the victim stays stopped (s; under the 10 s session timeout)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every taken-over stream with a local reference run (same model, seed, threads)")
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
    if not 0 < args.pause < 10:
        raise ValueError(f"--pause must be in (0, 10) s (the group's session timeout), got {args.pause}")
    res = asyncio.run(_bench(args))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"lockgate bench recovery --kills {args.kills} --requests {args.requests} --max-tokens {args.max_tokens} "
          f"--model {args.model} --prompt-tokens {args.prompt_tokens} --signal {args.signal} --bus {args.bus}"
          + ("" if args.failover else " --no-failover"))
    print(f"  {args.signal}s {res['kills']}, requests taken over {res['taken_over']}, re-run decode steps {res['rerun_steps']}")
    print(f"  {args.signal} -> next token on the client: p50 {res['recovery_p50_s']:.2f} s, p99 {res['recovery_p99_s']:.2f} s, "
          f"max {res['recovery_max_s']:.2f} s ({res['samples']} samples)")
    exact = "not checked" if res["exact"] is None else f"{res['exact']}/{res['exact_of']} byte-exact against a local reference"
    print(f"  streams as the edge delivers them: {exact}; gaps {res['gaps']}, splices refused {res['spliced']}, "
          f"fenced replies dropped {res['fenced']}")
    for line in res["inexact"] or ():
        print(f"    not exact: {line}")
    return 0
