"""An adapter beside a low-precision base (docs/lora.md): bf16 and int8 weight-only linears keep
float32 activations, so the adapter stays float32 and is added to their output. The adapter's
effect on the logits (adapter minus base, same engine) matches float32's within the base's own
quantization error; w8a8 is refused."""

from __future__ import annotations

import random

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from tests.engine_workers.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lowp") / "a",
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=7)


def effect(tiny_model_dir, adapter, **cfg) -> tuple[torch.Tensor, torch.Tensor]:
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, enable_lora=True,
                                 lora_modules=(("a", str(adapter)),), **cfg))
    rng = random.Random(3)
    ids = [rng.randrange(3, 512) for _ in range(24)]

    def logits(lora):
        return engine.runner.execute(ModelInput((Chunk(ids, 0, [0, 1], True),), every_row=True, loras=(lora,))).logits

    base = logits(None)
    return logits("a") - base, base


@pytest.mark.parametrize("cfg", [dict(quantization="int8"), dict(dtype="bfloat16")], ids=["int8", "bf16"])
def test_adapter_on_a_weight_only_base_has_the_float32_effect(tiny_model_dir, adapter, cfg):
    want, base32 = effect(tiny_model_dir, adapter)
    got, base = effect(tiny_model_dir, adapter, **cfg)
    assert want.abs().max() > 0.5  # the adapter changes the logits a lot
    quant_error = (base - base32).abs().max().item()  # what the low-precision base itself changes
    assert 0 < quant_error
    assert (got - want).abs().max().item() < 2 * quant_error + 1e-3
