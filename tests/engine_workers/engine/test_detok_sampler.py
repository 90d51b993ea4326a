"""Incremental detokenization (UTF-8 safety, stop strings) and the sampler."""

from __future__ import annotations

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.detokenizer import IncrementalDetokenizer
from engine_workers.engine.sampler import Row, Sampler, greedy_tokens
from lockgate_types import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, text, stop=()):
    ids = tok(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, [], stop)
    parts, stopped = [], False
    for t in ids:
        stopped = d.add(t)
        parts.append(d.release(final=stopped))
        if stopped:
            break
    else:
        parts.append(d.release(final=True))
    return parts, stopped


def test_deltas_never_split_a_multibyte_character(tok):
    text = "héllo 🙂 世界 ok"
    parts, _ = stream(tok, text)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    assert len(tok("🙂", add_special_tokens=False).input_ids) > 1  # the emoji really spans tokens


def test_stop_string_is_cut_and_never_leaks(tok):
    parts, stopped = stream(tok, "one two STOP three", stop=["STOP"])
    assert stopped and "".join(parts) == "one two "
    assert not any("S" in p for p in parts)


def test_greedy_tokens_pick_what_argmax_picks_ties_nan_and_all_inf_included():
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(0, 4, (5, 1000), generator=gen).float()  # many tied maxima per row
        if trial % 3 == 0:
            x[trial % 5, torch.randint(0, 1000, (2,), generator=gen)] = float("nan")
        if trial % 7 == 0:
            x[1] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1)), trial


def test_greedy_and_seeded_sampling():
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert s(logits, [Row(greedy), Row(greedy)]).token_ids == [1, 0]
    p = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(1, 100)
    # the draw for position k depends on (seed, k) only: the same k gives the same token every time
    a = [s(logits, [Row(p, 42, output_token_ids=[0] * k)]).token_ids[0] for k in range(20)]
    b = [s(logits, [Row(p, 42, output_token_ids=[0] * k)]).token_ids[0] for k in range(20)]
    assert a == b and len(set(a)) > 1


def test_top_k_top_p_restrict_support_and_logprobs():
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    k2 = SamplingParams(temperature=1.0, top_k=2)
    assert {s(logits, [Row(k2, seed)]).token_ids[0] for seed in range(200)} == {0, 1}
    p = SamplingParams(temperature=1.0, top_p=0.5)  # token 0 alone has ~64% of the mass
    assert {s(logits, [Row(p, seed)]).token_ids[0] for seed in range(100)} == {0}
    lp = SamplingParams(temperature=0, logprobs=2)
    res = s(logits, [Row(lp)])
    (entries,) = res.logprobs
    assert entries[0][0] == 0 and [e[0] for e in entries[1:]] == [0, 1]
    assert abs(sum(torch.tensor([e[1] for e in entries[1:]]).exp().tolist()) - 0.9) < 0.1
