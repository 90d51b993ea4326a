"""Priority preemption through the real engine (tiny model), as configured by default: a p0
request arriving while p2 work fills every sequence slot, or the KV cache, preempts a p2 request
by recompute and runs at once; every stream, the preempted ones included, is the stream the
request produces alone (sampled, seeded)."""

from __future__ import annotations

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate_types import SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny model: layers * (K, V) * block * kv_heads * head_dim * fp32


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


def reference(model_dir: str, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Each request's stream from an engine with room for all (nobody preempted)."""
    engine = Engine(EngineConfig(model=model_dir, num_threads=1, kv_cache_bytes=4 << 20, max_model_len=512))
    outs = engine.generate([p for p, _ in reqs.values()], [q for _, q in reqs.values()])
    assert engine.stats.preemptions == 0
    return {rid: list(o.token_ids) for rid, o in zip(reqs, outs)}


def run(engine: Engine, background: dict[str, tuple[list[int], SamplingParams]],
        chat: tuple[list[int], SamplingParams], after: int) -> tuple[dict[str, list[int]], list[str], int]:
    """Submit the p2 ``background`` requests, step until each has ``after`` tokens, submit the p0
    ``chat``, run everything to the end. Returns the streams, the order they finished in, and the
    steps from the chat's arrival to its first token."""
    for rid, (prompt, params) in background.items():
        engine.add_request(rid, prompt, params, priority=2.0, tier=2)
    tokens: dict[str, list[int]] = {rid: [] for rid in [*background, "chat"]}
    finished: list[str] = []

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finished.append(out.request_id)

    for _ in range(200):
        if all(len(tokens[r]) >= after for r in background):
            break
        step()
    assert not finished, "a p2 request finished before the p0 one arrived: make it longer"
    engine.add_request("chat", chat[0], chat[1], priority=0.0, tier=0)
    waited = 0
    while not tokens["chat"]:
        step()
        waited += 1
    for _ in range(2000):
        if len(finished) == len(tokens):
            break
        step()
    assert len(finished) == len(tokens)
    return tokens, finished, waited


def test_a_p0_arrival_preempts_when_every_slot_is_busy_and_streams_stay_exact(tiny_model_dir: str) -> None:
    background = {f"p2-{i}": ([11 + i, 12, 13, 14, 15], sampled(80, 40 + i)) for i in range(2)}
    chat = ([21, 22, 23, 24], sampled(6, 7))
    engine = Engine(EngineConfig(model=tiny_model_dir, num_threads=1, max_num_seqs=2, kv_cache_bytes=4 << 20,
                                 max_model_len=512))  # priority preemption: the default
    tokens, finished, waited = run(engine, background, chat, after=5)
    assert waited == 1  # its first token in the step it arrived for
    assert finished[0] == "chat"  # before either p2 request, though both had started first
    assert engine.stats.preemptions == 1
    assert tokens == reference(tiny_model_dir, {**background, "chat": chat})  # exact, the preempted one too
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_p0_arrival_preempts_when_the_kv_cache_is_full_with_slots_free(tiny_model_dir: str) -> None:
    # 10 blocks of 16 tokens; each p2 request takes 5 (70 prompt + 8 output tokens <= 80), so the
    # cache is full while 6 of the 8 slots are free; the chat needs 2 blocks
    background = {f"p2-{i}": ([30 + i] + list(range(40, 109)), sampled(8, 50 + i)) for i in range(2)}
    chat = ([21, 22, 23, 24] * 5, sampled(4, 9))
    engine = Engine(EngineConfig(model=tiny_model_dir, num_threads=1, max_num_seqs=8, kv_cache_bytes=10 * BLOCK_BYTES,
                                 max_model_len=128))
    assert engine.kv.num_blocks == 10
    tokens, finished, waited = run(engine, background, chat, after=2)
    assert waited == 1 and finished[0] == "chat"
    assert engine.stats.preemptions == 1
    assert tokens == reference(tiny_model_dir, {**background, "chat": chat})
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
