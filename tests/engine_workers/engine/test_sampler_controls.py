"""Sampling controls (#25) against references computed here, and counter-based draws (#22): the
token at output position k depends only on (seed, k), whatever the batch, and a resumed request
continues exactly like the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from bus import DecodeError, messages
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine, RequestOutput
from engine_workers.engine.sampler import Row, Sampler, uniform
from lockgate_types import SamplingParams

CPU = torch.device("cpu")
V = 40
EOS = 7


def crafted_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # positive and negative logits


# -- (a) each control against a reference -----------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = crafted_logits(2)
    prompt, output = [1, 2, 3, 3], [5, 9, 9, 2]
    p = SamplingParams(temperature=0, repetition_penalty=1.7)
    got = Sampler(CPU).process(logits, [Row(p, 0, prompt, output), Row(SamplingParams(temperature=0))])
    ref = logits.clone()
    for t in set(prompt) | set(output):
        v = float(logits[0, t])
        ref[0, t] = v / 1.7 if v > 0 else v * 1.7
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[1], logits[1])  # the other row is untouched


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = crafted_logits(1, seed=1)
    prompt, output = [4, 4, 11], [11, 6, 6, 6, 20]
    p = SamplingParams(temperature=0.8, presence_penalty=0.75, frequency_penalty=-0.4)
    got = Sampler(CPU).process(logits, [Row(p, 0, prompt, output)])
    ref = logits.clone()
    for t in set(output):
        ref[0, t] -= 0.75 + (-0.4) * output.count(t)
    torch.testing.assert_close(got, ref)
    assert got[0, 4] == logits[0, 4]  # prompt-only token: no presence/frequency penalty


def test_penalties_then_logit_bias_in_that_order():
    logits = crafted_logits(1, seed=2)
    prompt, output = [3], [3, 8, 8]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias=((8, -2.0), (30, 5.5)))
    got = Sampler(CPU).process(logits, [Row(p, 0, prompt, output)])
    ref = logits[0].clone()
    for t in {3, 8}:
        v = float(ref[t])
        ref[t] = v / 1.3 if v > 0 else v * 1.3
        ref[t] -= 0.5 + 0.25 * output.count(t)
    ref[8] += -2.0
    ref[30] += 5.5
    torch.testing.assert_close(got[0], ref)


def test_logit_bias_steers_greedy_and_sampled_rows():
    logits = crafted_logits(3, seed=3)
    low = int(logits[0].argmin())
    bias = SamplingParams(temperature=0, logit_bias={low: 100.0})  # type: ignore[arg-type]  # a mapping is accepted
    assert bias.logit_bias == ((low, 100.0),)
    sampled = SamplingParams(temperature=1.0, logit_bias=((low, 100.0),))
    res = Sampler(CPU)(logits[[0, 0, 1]], [Row(bias), Row(sampled, 5), Row(SamplingParams(temperature=0))])
    assert res.token_ids == [low, low, int(logits[1].argmax())]
    # a ban (-100) removes the greedy choice: the runner-up wins
    top2 = logits[2].topk(2).indices.tolist()
    ban = SamplingParams(temperature=0, logit_bias=((top2[0], -100.0),))
    assert Sampler(CPU)(logits[2:], [Row(ban)]).token_ids == [top2[1]]


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability():
    logits = crafted_logits(2, seed=4)
    params = [SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=1.3, min_p=0.0)]
    got = Sampler.filtered_probs(logits.clone(), params)
    for i, p in enumerate(params):
        probs = (logits[i] / p.temperature).softmax(-1)
        keep = probs >= p.min_p * probs.max()
        ref = torch.where(keep, probs, torch.zeros_like(probs))
        torch.testing.assert_close(got[i], ref)
    assert (got[0] == 0).sum() > 0 and (got[1] > 0).all()
    # drawn tokens stay inside the kept set, and every kept token can be drawn
    s = Sampler(CPU)
    support = {s(logits[:1], [Row(params[0], seed)]).token_ids[0] for seed in range(3000)}
    assert support == set(torch.nonzero(got[0]).flatten().tolist())


def test_top_k_top_p_then_min_p_compose_like_the_reference():
    logits = crafted_logits(1, seed=5)
    p = SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05)
    got = Sampler.filtered_probs(logits.clone(), [p])[0]
    x = logits[0] / 0.9
    order = sorted(range(V), key=lambda t: (-float(x[t]), t))
    kept = order[:12]
    probs = x[kept].softmax(-1).tolist()
    mass, top_p_kept = 0.0, []
    for t, pr in zip(kept, probs):
        if mass >= 0.8:
            break
        top_p_kept.append(t)
        mass += pr
    q = x[top_p_kept].softmax(-1)
    final = {t for t, pr in zip(top_p_kept, q.tolist()) if pr >= 0.05 * float(q.max())}
    assert set(torch.nonzero(got).flatten().tolist()) == final
    ref = torch.zeros(V)
    ref[top_p_kept] = q
    ref[[t for t in range(V) if t not in final]] = 0
    torch.testing.assert_close(got, ref)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 50.0
    logits[:, 12] = 40.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(12,))
    s = Sampler(CPU, eos_token_ids=[EOS])
    rows = [Row(p, 0, [1], [2, 2]), Row(p, 0, [1], [2, 2, 2]),
            Row(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), 0, [1], [2]), Row(SamplingParams(temperature=0))]
    x = s.process(logits, rows)
    assert x[0, EOS] == float("-inf") and x[0, 12] == float("-inf")
    assert torch.equal(x[1], logits[1])  # reached: nothing masked
    assert x[2, EOS] == 50.0  # ignore_eos: EOS does not stop, so it is not suppressed
    assert s(logits, rows).token_ids == [int(torch.cat([logits[0, :EOS], logits[0, EOS + 1 : 12]]).argmax()), EOS, EOS, EOS]


def test_batched_rows_match_rows_sampled_alone():
    logits = crafted_logits(6, seed=6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1, top_p=0.9),
              SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.2),
              SamplingParams(temperature=0, presence_penalty=1.0, logit_bias=((3, 4.0),)),
              SamplingParams(temperature=0.5, top_k=5, frequency_penalty=0.5),
              SamplingParams(temperature=1.0)]
    rows = [Row(p, 100 + i, [1, 2, 3], [4, 4, 5 + i]) for i, p in enumerate(params)]
    s = Sampler(CPU)
    together = s(logits, rows).token_ids
    alone = [s(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(len(rows))]
    assert together == alone


def test_inverse_cdf_draws_follow_the_distribution():
    probs = torch.tensor([0.05, 0.5, 0.0, 0.3, 0.15])
    logits = probs.log()[None]
    p = SamplingParams(temperature=1.0)
    s = Sampler(CPU)
    n = 4000
    counts = torch.bincount(torch.tensor([s(logits, [Row(p, seed)]).token_ids[0] for seed in range(n)]), minlength=5)
    assert counts[2] == 0
    assert torch.allclose(counts / n, probs, atol=0.03)
    us = [uniform(7, k) for k in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.03


def test_draw_depends_only_on_seed_and_position():
    assert uniform(5, 3) == uniform(5, 3)
    assert len({uniform(5, k) for k in range(100)}) == 100
    assert uniform(5, 3) != uniform(6, 3)
    logits = crafted_logits(1, seed=8)
    p = SamplingParams(temperature=1.0)
    s = Sampler(CPU)
    # the position is the number of output tokens, whatever they are
    assert s(logits, [Row(p, 9, [1], [3, 4])]).token_ids == s(logits, [Row(p, 9, [2, 2, 2], [30, 31])]).token_ids


# -- engine: min_tokens, batch independence, resume, seeds -------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, max_num_seqs=8))


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_min_tokens_suppresses_eos_on_the_tiny_model(engine):
    eos = min(engine.eos_token_ids)
    eager = SamplingParams(temperature=0, max_tokens=20, logit_bias=((eos, 100.0),))  # EOS at once otherwise
    engine.add_request("eager", [5, 6, 7], eager)
    out = drain(engine)["eager"]
    assert tokens(out) == [eos] and out[-1].finish_reason == "stop"
    engine.add_request("min5", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias=((eos, 100.0),)))
    engine.add_request("min3s", [5, 6, 7], SamplingParams(temperature=0.9, seed=3, max_tokens=20, min_tokens=3,
                                                          logit_bias=((eos, 100.0),)))
    outs = drain(engine)
    for rid, n in (("min5", 5), ("min3s", 3)):
        got = tokens(outs[rid])
        assert len(got) == n + 1 and eos not in got[:n] and got[-1] == eos, (rid, got)
        assert outs[rid][-1].finish_reason == "stop"
    stop_tok = 100
    engine.add_request("stoptok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, min_tokens=4, ignore_eos=True,
                                                            stop_token_ids=(stop_tok,), logit_bias=((stop_tok, 100.0),)))
    got = tokens(drain(engine)["stoptok"])
    assert len(got) == 5 and stop_tok not in got[:4] and got[-1] == stop_tok


SEEDED = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.3,
                        frequency_penalty=0.2, seed=4242, max_tokens=24, ignore_eos=True)
PROMPT = [9, 10, 11, 12]


def test_token_at_position_k_is_the_same_alone_or_in_a_batch_of_eight(engine):
    engine.add_request("alone", PROMPT, SEEDED)
    alone = tokens(drain(engine)["alone"])
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.7, seed=1, top_k=20, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.1, presence_penalty=1.0, max_tokens=16),
              SamplingParams(temperature=0.9, logit_bias=((5, 3.0),), max_tokens=20),
              SamplingParams(temperature=0.6, seed=4242, max_tokens=25, ignore_eos=True),  # same seed, other prompt
              SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, max_tokens=28)]
    for i, p in enumerate(others):
        engine.add_request(f"noise{i}", list(range(3 + 7 * i, 20 + 9 * i)), p)
    engine.add_request("batched", PROMPT, SEEDED)
    outs = drain(engine)
    assert tokens(outs["batched"]) == alone
    assert len(alone) == 24 and all(o.seed == 4242 for o in outs["batched"])


def test_resumed_request_continues_with_the_uninterrupted_tokens(engine, tiny_model_dir):
    engine.add_request("full", PROMPT, SEEDED)
    full_outs = drain(engine)["full"]
    full = tokens(full_outs)
    # another engine (another engine seed: it must not matter) resumes at position k
    other = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, max_num_seqs=8, seed=99))
    for k in (1, 9, 17):
        other.add_request(f"resumed{k}", PROMPT, SEEDED, resume_token_ids=full[:k])
        outs = drain(other)[f"resumed{k}"]
        assert tokens(outs) == full[k:]
        assert outs[0].seq == k and outs[-1].num_output_tokens == len(full)
        # the text continues where the first run had released it
        first = next(o for o in full_outs if o.seq == k)
        assert outs[0].text_offset == first.text_offset
        assert "".join(o.text for o in outs) == "".join(o.text for o in full_outs if o.seq >= k)


def test_resume_rejects_finished_or_invalid_token_lists(engine):
    eos = min(engine.eos_token_ids)
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request("r1", PROMPT, SamplingParams(max_tokens=3), resume_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request("r2", PROMPT, SamplingParams(max_tokens=8), resume_token_ids=[5, eos])
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request("r3", PROMPT, SamplingParams(max_tokens=8), resume_token_ids=[10**6])
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r4", PROMPT, SamplingParams(logit_bias=((10**6, 1.0),)))
    assert not engine.has_unfinished()


def test_same_seed_same_tokens_other_seed_other_tokens(engine):
    p = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    runs = engine.generate([PROMPT, PROMPT, PROMPT], [p, p, SamplingParams(temperature=0.8, seed=8, max_tokens=20, ignore_eos=True)])
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids
    assert [r.seed for r in runs] == [7, 7, 8]


def test_unseeded_requests_get_a_seed_that_reproduces_them(engine):
    p = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    a, b = engine.generate([PROMPT, PROMPT], p)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a.token_ids != b.token_ids
    (again,) = engine.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=a.seed))
    assert again.token_ids == a.token_ids


# -- (e) the wire validates untrusted values, naming the field --------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
    ({"logit_bias": ((True, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, 2, 3),)}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
])
def test_wire_rejects_bad_controls_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        messages.SamplingParams(**kwargs)


def test_wire_controls_round_trip_and_reach_the_engine():
    wire = messages.SamplingParams(min_p=0.05, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=2,
                                   logit_bias=((9, -100), (3, 2.5)), min_tokens=4, max_tokens=10)
    req = messages.InferenceRequest("r", "m", (1, 2), wire, "replies")
    back = messages.decode(messages.encode(req))
    assert back == req
    ep = back.sampling  # the decoded record's parameters are the engine's, no conversion between
    assert type(ep) is SamplingParams
    assert (ep.min_p, ep.repetition_penalty, ep.presence_penalty, ep.frequency_penalty, ep.min_tokens) == (0.05, 1.2, -0.5, 2.0, 4)
    assert ep.logit_bias == ((3, 2.5), (9, -100.0))
    bad = messages.encode(req).replace(b'"min_p":0.05', b'"min_p":7')
    with pytest.raises(DecodeError, match="min_p"):
        messages.decode(bad)
    bad = messages.encode(req).replace(b"[9,-100.0]", b'[9,"x"]')
    with pytest.raises(DecodeError, match="logit_bias"):
        messages.decode(bad)
