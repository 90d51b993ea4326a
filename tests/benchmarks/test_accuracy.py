"""`lockgate bench accuracy`: the harness drives the engine as the engine itself does (greedy tokens
equal ``Engine.generate``'s, perplexity equals HF's forward), compares a mode with itself exactly,
and every precision mode this build has stays within bounds of float32 (tiny model here; SmolLM2 in
the slow test, where bf16 and int8 perplexity must be within 1% of float32's).

Bounds are measured values with margin (docs/benchmarks.md, Accuracy, has the full-size figures).
Tiny random model, 4 prompts x 8 tokens, 2,000 text tokens, measured 2026-12-05: bf16 agreement
0.97, logits rel L2 mean 0.010 / max 0.019, perplexity ratio 0.9999; int8 0.97, 0.034 / 0.063,
0.9995. Its top logits are nearly tied (random weights), so a mode flips more tokens there than on
a trained model. Modes not in this build yet carry loose provisional bounds, to be replaced by
measured ones when they merge."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.engine import accuracy as acc
from engine_workers.engine import torch_thread
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate.cli import build_parser
from lockgate_types import SamplingParams


@pytest.fixture(scope="module")
def text() -> str:
    return acc.TEXT_FILE.read_text()


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=tiny_model_dir, kv_cache_bytes=16 << 20, enable_prefix_caching=False)


TINY = {"prompts": 4, "steps": 8, "text_tokens": 2000, "window": 256, "stride": 192}


@pytest.fixture(scope="module")
def tiny_reference(tiny_config, text) -> acc.Reference:
    return torch_thread.call(acc.reference, tiny_config, acc.load_prompts(TINY["prompts"]), TINY["steps"], text,
                             TINY["text_tokens"], TINY["window"], TINY["stride"])


def test_shipped_text_is_the_documented_slice(text):
    import hashlib

    readme = (acc.DATA / "README.md").read_text()
    assert hashlib.sha256(text.encode()).hexdigest() in readme
    assert len(acc.load_prompts(64)) == 64


def test_greedy_driver_equals_engine_generate(tiny_config, tiny_reference):
    engine = Engine(tiny_config)
    done = engine.generate(tiny_reference.prompts, SamplingParams(temperature=0.0, max_tokens=TINY["steps"], ignore_eos=True))
    assert [list(d.token_ids) for d in done] == tiny_reference.tokens
    # the stored logits are the ones the tokens were picked from
    assert tiny_reference.logits.argmax(-1).tolist() == tiny_reference.tokens


def test_perplexity_equals_hf_forward(tiny_model_dir, tiny_reference):
    """Every target of the text scored once (stride < window: overlapping windows score only new
    targets), each against HF's logits over the same window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(acc.TEXT_FILE.read_text(), add_special_tokens=True)["input_ids"][: TINY["text_tokens"]]
    assert tiny_reference.text_tokens == len(ids) and tiny_reference.nll_count == len(ids) - 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    window, stride = TINY["window"], TINY["stride"]
    total, scored_to, begin = 0.0, 1, 0
    with torch.inference_mode():
        while True:
            end = min(begin + window, len(ids))
            logits = model(torch.tensor([ids[begin:end]])).logits[0, :-1]
            targets = torch.tensor(ids[begin + 1 : end])
            skip = scored_to - (begin + 1)
            total += float(F.cross_entropy(logits[skip:], targets[skip:], reduction="sum"))
            scored_to = end
            if end == len(ids):
                break
            begin += stride
    assert tiny_reference.nll == pytest.approx(total, rel=1e-4)


def test_disjoint_windows_leave_each_first_token_as_context(tiny_config, text):
    def run():
        engine = Engine(tiny_config)
        ids = engine.prompts.text_ids(text)[:600]
        return acc.text_nll(engine.runner, ids, 256, 256)

    _nll, count = torch_thread.call(run)
    assert count == 600 - 3  # windows at 0, 256, 512: each scores all but its first token


# Bounds: (min teacher-forced agreement, max rel L2 mean, max rel L2 max, max |perplexity ratio - 1|)
TINY_BOUNDS = {
    "bf16": (0.8, 0.03, 0.08, 0.005),
    "int8": (0.75, 0.08, 0.2, 0.01),
    # measured 2026-12-05 (agreement, rel L2 mean / max, |ppl ratio - 1|), bounds with margin:
    # q4_1 quantized at load 0.44, 0.43 / 0.64, 0.017 (random weights: 16 levels per group of 32 lose
    # much of a random Gaussian's detail; the default model's GGUF blocks are exact instead);
    # bf16-kv 1.0, 0.006 / 0.010, 0.0004; w8a8 0.94, 0.050 / 0.11, 0.0013; w8a8-bf16kv (the prefill
    # kernel's float16 pass on CPUs with AVX512-FP16) 0.97, 0.050 / 0.10, 0.0023
    "q4_1": (0.3, 0.6, 0.9, 0.05),
    "bf16-kv": (0.8, 0.02, 0.04, 0.003),
    "w8a8": (0.75, 0.1, 0.25, 0.01),
    "w8a8-bf16kv": (0.75, 0.1, 0.25, 0.01),
}


@pytest.mark.parametrize("name", list(acc.MODES))
def test_mode_within_bounds_tiny(name, tiny_config, tiny_reference, text):
    if (why := acc.mode_problem(name)) is not None:
        pytest.skip(why)
    try:
        r = torch_thread.call(acc.measure_mode, tiny_config, name, tiny_reference, text, TINY["window"], TINY["stride"])
    except acc.ModeUnavailable as exc:  # e.g. kernels this CPU lacks: the engine fell back to float32
        pytest.skip(str(exc))
    assert r.positions == TINY["prompts"] * TINY["steps"]
    assert math.isfinite(r.perplexity) and r.perplexity > 1
    if name == "auto" and r.weights == "bfloat16":  # an AMX host running at the amx level
        name = "bf16"
    if name in ("fp32", "auto"):  # the reference re-run (auto: float32 off AMX): deterministic and exact
        assert (r.token_agreement, r.identical, r.prefix_mean) == (1.0, 1.0, TINY["steps"])
        assert r.rel_l2_max == 0.0 and r.perplexity_ratio == 1.0
        return
    agree, l2_mean, l2_max, ppl = TINY_BOUNDS[name]
    assert r.token_agreement >= agree
    assert 0 < r.rel_l2_mean <= l2_mean and r.rel_l2_max <= l2_max
    assert abs(r.perplexity_ratio - 1) <= ppl
    assert 0 <= r.prefix_mean <= TINY["steps"] and 0 <= r.identical <= 1


def test_mode_detection_names_what_the_build_lacks(monkeypatch):
    monkeypatch.setitem(acc.MODES, "future", acc.Mode("future", {"no_such_field": 1}, None))
    monkeypatch.setitem(acc.MODES, "int3", acc.Mode("int3", {"quantization": "int3"}, None))
    assert "EngineConfig.no_such_field" in acc.mode_problem("future")
    assert "not supported by this build" in acc.mode_problem("int3") and "int3" in acc.mode_problem("int3")
    assert "unknown accuracy mode 'fp64'" in acc.mode_problem("fp64")
    assert acc.mode_problem("fp32") is None
    assert acc.mode_config(EngineConfig(dtype="bfloat16"), "fp32").dtype == "float32"  # modes set the precision


def test_cli_refuses_an_unknown_mode(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "accuracy", "--modes", "fp32,fp64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--modes" in err and "unknown accuracy mode 'fp64'" in err and "bf16" in err


def test_cli_writes_the_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "acc.json"
    args = build_parser().parse_args(["bench", "accuracy", "--model", tiny_model_dir, "--kv-cache-bytes", "16M",
                                      "--modes", "fp32", "--prompts", "2", "--new-tokens", "3", "--text-tokens", "300",
                                      "--window", "128", "--stride", "128", "--out", str(out)])
    assert args.func(args) == 0
    import json

    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] and report["text_tokens"] == 300 and report["ppl_targets"] == 300 - 3
    assert report["reference_perplexity"] == report["results"][0]["perplexity"]
    (row,) = report["results"]
    assert row["mode"] == "fp32" and row["token_agreement"] == 1.0 and row["positions"] == 6
    assert "fp32" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_bf16_int8_perplexity_within_one_percent(default_model_dir, text):
    """The issue's target on the default model: bf16 and int8 perplexity within 1% of float32's
    (2,048 tokens here; the full text in docs/benchmarks.md), and greedy agreement bounds."""
    names = [n for n in ("bf16", "int8") if acc.mode_problem(n) is None]
    # 64 MiB of KV: one 1,024-token window (a default-sized cache costs a GiB of zeros per engine)
    config = EngineConfig(model=default_model_dir, device="cpu", kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    try:
        report = acc.measure(config, names, acc.load_prompts(4), 8, text, text_tokens=2048, window=1024, stride=1024)
    except acc.ModeUnavailable as exc:
        pytest.skip(str(exc))
    rows = {r.mode: r for r in report.results}
    for name, (agree, l2_mean) in {"bf16": (0.9, 0.02), "int8": (0.8, 0.1)}.items():
        r = rows[name]
        assert abs(r.perplexity_ratio - 1) <= 0.01, f"{name} perplexity {r.perplexity:.4f} vs float32 ratio {r.perplexity_ratio:.4f}"
        assert r.token_agreement >= agree and r.rel_l2_mean <= l2_mean
