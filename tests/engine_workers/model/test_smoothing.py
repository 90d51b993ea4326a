"""w8a8's activation smoothing (engine_workers/model/execution/smoothing.py): it leaves the float32 model's
function as it was, it is what the engine loads for ``--quantization w8a8``, and on a model with
outlier input channels (what real checkpoints have, and what made w8a8's error a matter of chance
between hosts, issue #47) it brings w8a8's error down."""

from __future__ import annotations

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels.w8a8_linear import w8a8_problem
from engine_workers.model.execution import smoothing
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import ModelRunner
from engine_workers.model.loading.loader import load_model, quantize_linears
from engine_workers.model.models.llama import RMSNorm
from tests.engine_workers.kernels.test_lowp_weights import rel_l2

CPU = torch.device("cpu")
BLOCK = 16
needs_w8a8 = pytest.mark.skipif(w8a8_problem() is not None, reason=f"W8A8: {w8a8_problem()}")


def logits(loaded, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits of each prompt, run alone from position 0 on a runner of its own."""
    runner = ModelRunner(loaded, 64, BLOCK, CPU, torch.float32, True, torch.float32)
    return torch.stack([runner.execute(ModelInput((Chunk(p, 0, list(range(-(-len(p) // BLOCK))), True),))).logits[0].float()
                        for p in prompts])


def with_outliers(loaded) -> None:
    """A few input channels of every layer tens of times the rest, as trained models have them:
    the norms before attention and the MLP scale them up, the weights reading them scale down
    (the float32 function barely changes; per-row int8 activations lose the other channels)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in loaded.model.layers:
            for norm, lin in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                              (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                ch = torch.randperm(norm.weight.numel(), generator=g)[:3]
                norm.weight[ch] *= 60.0
                lin.weight[:, ch] /= 8.0


def prompts_of(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(t) for t in ("hello there, how are you", "the quick brown fox jumps", "1 2 3 4 5 6 7 8 9")]


def test_calibration_text_is_read_through_the_chat_template(tiny_model_dir: str) -> None:
    loaded = load_model(tiny_model_dir, torch.float32, CPU, weight_prepack=False)
    ids = smoothing.calibration_ids(loaded.tokenizer)
    assert 100 < len(ids) <= smoothing.CALIBRATION_TOKENS
    assert ids == smoothing.calibration_ids(loaded.tokenizer)  # fixed: every worker folds the same factors
    plain = loaded.tokenizer.encode(smoothing.CALIBRATION)
    assert ids[:5] != plain[:5]  # the template's opening, not the bare text


def test_smoothing_keeps_the_float32_function(tiny_model_dir: str) -> None:
    loaded = load_model(tiny_model_dir, torch.float32, CPU, weight_prepack=False)
    with_outliers(loaded)
    prompts = prompts_of(loaded)
    before = logits(loaded, prompts)
    norms = [n.weight.clone() for n in loaded.model.modules() if isinstance(n, RMSNorm)]
    ids = smoothing.calibration_ids(loaded.tokenizer)
    probe = ModelRunner(loaded, 64, BLOCK, CPU, torch.float32, True, torch.float32)
    stats = smoothing.input_maxima(loaded.model, lambda: probe.execute(ModelInput((Chunk(ids, 0, list(range(-(-len(ids) // BLOCK))), True),))))
    n_layers = len(loaded.model.layers)
    assert len(stats) == 4 * n_layers and all(bool((v >= 0).all()) for v in stats.values())
    report = smoothing.smooth(loaded.model, stats, len(ids))
    assert (report.layers, report.linears, report.tokens) == (n_layers, 4 * n_layers, len(ids))
    after = logits(loaded, prompts)
    assert rel_l2(after, before) < 1e-5
    # it did change the weights: the outlier channels' norm entries shrank
    changed = [n.weight for n in loaded.model.modules() if isinstance(n, RMSNorm)]
    assert any(not torch.equal(a, b) for a, b in zip(changed, norms))


@needs_w8a8
def test_smoothing_lowers_w8a8_error_on_outlier_channels(tiny_model_dir: str) -> None:
    ref = load_model(tiny_model_dir, torch.float32, CPU, weight_prepack=False)
    with_outliers(ref)
    prompts = prompts_of(ref)
    want = logits(ref, prompts)

    def w8a8(smoothed: bool) -> float:
        loaded = load_model(tiny_model_dir, torch.float32, CPU, weight_prepack=False)
        with_outliers(loaded)
        if smoothed:
            ids = smoothing.calibration_ids(loaded.tokenizer)
            probe = ModelRunner(loaded, 64, BLOCK, CPU, torch.float32, True, torch.float32)
            stats = smoothing.input_maxima(
                loaded.model, lambda: probe.execute(ModelInput((Chunk(ids, 0, list(range(-(-len(ids) // BLOCK))), True),))))
            smoothing.smooth(loaded.model, stats, len(ids))
        quantize_linears(loaded.model, "w8a8")
        return rel_l2(logits(loaded, prompts), want)

    plain, smoothed = w8a8(False), w8a8(True)
    assert smoothed < 0.6 * plain, (smoothed, plain)


@needs_w8a8
def test_engine_loads_w8a8_smoothed(tiny_model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="engine_workers.model.execution.smoothing"):
        eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", quantization="w8a8", max_num_seqs=4))
    assert eng.weight_format == "w8a8"
    assert "activation smoothing" in caplog.text
    # same model, same text, same kernels: the same weights (exact resume across workers)
    again = Engine(EngineConfig(model=tiny_model_dir, device="cpu", quantization="w8a8", max_num_seqs=4))
    a, b = eng.runner.model.layers[0].mlp.gated, again.runner.model.layers[0].mlp.gated
    assert torch.equal(a.gate_up.q, b.gate_up.q) and torch.equal(a.down.scale, b.down.scale)
