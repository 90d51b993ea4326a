"""A seeded, repeated kill -9 fault suite on a real Kafka broker (issue #38): two worker processes,
each round a fresh seeded mix of sampled requests (temperature 0.8, top-p, top-k, n > 1 as the
edge sends it, stop strings, structured output, a shared prompt prefix for prefix-cache hits,
mixed lengths and batch sizes), one fault per round, and every stream must equal its healthy
re-run (the reference engine with the same seeds) token for token, each seq once.

Faults, in turn: kill -9 mid-stream (a worker has streamed k tokens of a request with more to
go, k seeded), kill during prefill (a worker has requests running and has published no token of
this round: long prompts, chunked prefill), kill during the reply send (at the victim's first
published chunk), and both workers killed one after the other (with a third worker in the
group: the second is killed once it streams a request it took over from the first). Every kill moment is an
observed condition with a deadline. After each round the killed workers are replaced (a new
process and id), so the next round runs on two live workers again.

Rounds: ``LOCKGATE_FAULT_ROUNDS`` (default 4: each fault once; docs/benchmarks-robustness.md
has the cost and the figures of longer runs)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from bus import Finished, InferenceRequest, SamplingParams, connect
from tests.engine_workers.worker.test_worker_kafka import (
    assert_exact_streams,
    assigned,
    free_port,
    kafka_url,
    kill_when_streaming,
    new_layout,
    spawn_worker,
    wait_ready,
)
from tests.engine_workers.worker.test_worker_memory import (
    MODEL,
    Replies,
    make_engine,
    publish,
    tiny_dir,  # noqa: F401 - a fixture
)
from tests.waiting import wait_until

ROUNDS = int(os.environ.get("LOCKGATE_FAULT_ROUNDS", "4"))
FAULTS = ("mid_stream", "prefill", "reply_send", "both")
pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240 + 120 * ROUNDS)]
SCHEMA = orjson.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                       "required": ["a", "b"]}).decode()
# chunked prefill (a long prompt takes several steps: the prefill fault's window) and batches of
# up to 6 rows
WORKER_ARGS = ("--max-num-batched-tokens", "48")


def round_mix(seed: int, fault: str, rid_prefix: str, reply_to: str) -> list[InferenceRequest]:
    """One round's requests: every sampling setting, seeds as the edge draws them."""
    rng = random.Random(seed)
    long = fault == "prefill"
    shared = tuple(rng.randrange(3, 500) for _ in range(rng.randint(32, 64)))  # prefix-cache hits

    def prompt() -> tuple[int, ...]:
        tail = tuple(rng.randrange(3, 500) for _ in range(rng.randint(120, 240) if long else rng.randint(4, 40)))
        return (shared + tail) if rng.random() < 0.5 else tail

    def length() -> int:  # long enough that a kill lands while streams are in hand, on a fast model too
        return rng.randint(60, 140)

    settings: list[tuple[tuple[int, ...], SamplingParams]] = [
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, ignore_eos=True)),
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, top_p=0.9, ignore_eos=True)),
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, top_k=20, ignore_eos=True)),
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, stop=("e ", "ab"), ignore_eos=True)),
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, guided_json=SCHEMA)),
        (prompt(), SamplingParams(max_tokens=length(), temperature=0.8, top_p=0.95, top_k=40, ignore_eos=True)),
    ]
    # n = 3 as the edge sends it: one request per choice, seeds seed, seed + 1, seed + 2
    p, base = prompt(), SamplingParams(max_tokens=length(), temperature=0.8, ignore_eos=True).seeded()
    assert base.seed is not None
    settings += [(p, SamplingParams(max_tokens=base.max_tokens, temperature=0.8, ignore_eos=True,
                                    seed=(base.seed + i) % (1 << 63))) for i in range(3)]
    rng.shuffle(settings)
    return [InferenceRequest(f"{rid_prefix}-{i}", MODEL, pr, sp.seeded(), reply_to, tier=1, enqueued_at=time.time())
            for i, (pr, sp) in enumerate(settings)]


def running(port: int) -> float:
    """The worker's ``lockgate:num_requests_running`` summed over its labels (0 when unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lockgate:num_requests_running{"))


class Fleet:
    """Worker processes on one layout; ``start`` a new one (its own id and metrics port)."""

    def __init__(self, bootstrap: str, model_dir: Path, layout, logs: Path) -> None:
        self.bootstrap, self.model_dir, self.layout, self.logs = bootstrap, model_dir, layout, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    async def start(self, *ids: str) -> None:
        for w in ids:
            self.ports[w] = free_port()
            self.procs[w] = spawn_worker(self.bootstrap, self.model_dir, self.layout, w, self.logs / f"{w}.log",
                                         self.ports[w], max_num_seqs=6, extra=WORKER_ARGS)
        for w in ids:
            await wait_ready(self.procs[w])

    def live(self) -> dict[str, subprocess.Popen]:
        return {w: p for w, p in self.procs.items() if p.poll() is None}

    async def settled(self) -> None:
        """Every live worker holds partitions (the last join's rebalance is over)."""
        ports = [self.ports[w] for w in self.live()]
        await wait_until(lambda: asyncio.to_thread(lambda: all(assigned(p) for p in ports)), timeout=60,
                         interval=0.1, message="live workers holding partitions")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()


async def kill_in_prefill(replies: Replies, fleet: Fleet, timeout: float = 60) -> str:
    """SIGKILL the first live worker seen with requests running and no token of this round
    published yet; returns it once it has exited."""
    found: list[str] = []

    async def observed() -> bool:
        await replies.poll(10)
        streamed = {c.worker_id for c in replies.chunks}
        for w in fleet.live():
            if w not in streamed and await asyncio.to_thread(running, fleet.ports[w]) > 0:
                found.append(w)
                return True
        return False

    await wait_until(observed, timeout=timeout, interval=0, message="no worker seen prefilling")
    fleet.procs[found[0]].send_signal(signal.SIGKILL)
    await asyncio.to_thread(fleet.procs[found[0]].wait, 10)
    return found[0]


async def test_kill9_fault_rounds_every_sampled_stream_exact(kafka_bootstrap: str, tiny_dir: Path,
                                                            tmp_path: Path) -> None:
    layout = new_layout()
    topics = [layout.reply_topic(f"r{r}") for r in range(ROUNDS)]
    rounds = [round_mix(9000 + r, FAULTS[r % len(FAULTS)], f"r{r}", topics[r]) for r in range(ROUNDS)]
    engine = make_engine(tiny_dir, max_num_seqs=8)
    refs = [engine.generate([q.prompt_token_ids for q in reqs], [q.sampling for q in reqs])
            for reqs in rounds]
    del engine
    exact = total = 0
    figures = []
    t_start = time.monotonic()
    fleet = Fleet(kafka_bootstrap, tiny_dir, layout, tmp_path)
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec(f"r{r}", 1) for r in range(ROUNDS)])
        try:
            await fleet.start("w0", "w1")
            spawned = 2
            for r, (reqs, ref) in enumerate(zip(rounds, refs)):
                fault = FAULTS[r % len(FAULTS)]
                if fault == "both":  # a third worker, to take over when two are dead
                    spawned += 1
                    await fleet.start(f"w{spawned - 1}")
                await fleet.settled()
                replies = Replies(bus, topics[r])
                await replies.consumer.start()
                try:
                    for q in reqs:
                        await publish(bus, layout, q)
                    max_tokens = {q.request_id: q.sampling.max_tokens for q in reqs}
                    killed: list[str] = []
                    k = random.Random(r).randint(2, 8)
                    if fault == "prefill":
                        killed.append(await kill_in_prefill(replies, fleet))
                    elif fault == "reply_send":
                        killed.append((await kill_when_streaming(replies, fleet.live(), max_tokens, after=1,
                                                                 margin=30))[0])
                    else:
                        victim, _ = await kill_when_streaming(replies, fleet.live(), max_tokens, after=k, margin=30)
                        killed.append(victim)
                        if fault == "both":
                            # a second worker dies too, once it streams a request it took over from
                            # the first; the one left (of three this round) finishes everything
                            taken = {c.request_id for c in replies.chunks if c.worker_id == victim}
                            second, _ = await kill_when_streaming(
                                replies, fleet.live(),
                                {rid: n for rid, n in max_tokens.items() if rid in taken}, after=1, margin=20)
                            killed.append(second)
                    await replies.wait([q.request_id for q in reqs], 150)
                    ok = 0
                    for q, expected in zip(reqs, ref):
                        fin = replies.final[q.request_id]
                        assert isinstance(fin, Finished), fin
                        got = replies.stream(q.request_id)
                        ok += got == list(expected.token_ids)
                    exact += ok
                    total += len(reqs)
                    figures.append(f"round {r} ({fault}, killed {'+'.join(killed)}): {ok}/{len(reqs)} exact")
                    print(figures[-1], flush=True)
                    assert ok == len(reqs), figures[-1]
                    assert_exact_streams(replies, reqs, ref)
                finally:
                    await replies.consumer.stop()
                # replace the dead: the next round starts on two live workers again
                missing = 2 - len(fleet.live())
                new = [f"w{spawned + i}" for i in range(missing)]
                spawned += missing
                if new:
                    await fleet.start(*new)
        finally:
            fleet.close()
    print(f"kill -9 fault suite: {exact}/{total} streams exact over {ROUNDS} rounds "
          f"in {time.monotonic() - t_start:.0f} s", flush=True)
    assert exact == total
