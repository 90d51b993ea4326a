"""What the adapter loader and the engine refuse, each naming what is wrong, and what they accept:
every field PEFT writes at its default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.model.lora.adapter import load_adapter
from engine_workers.model.lora.peft_config import LoraError
from engine_workers.model.models.spec import ModelSpec
from tests.engine_workers.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def spec(tiny_model_dir) -> ModelSpec:
    from transformers import AutoConfig

    return ModelSpec.from_hf(AutoConfig.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("plain") / "a", ["q_proj", "down_proj"], r=4)


def edited(plain: Path, tmp_path: Path, **fields) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    cfg = json.loads((plain / "adapter_config.json").read_text())
    cfg.update(fields)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes((plain / "adapter_model.safetensors").read_bytes())
    return out


def test_peft_defaults_load(plain, spec):
    raw = json.loads((plain / "adapter_config.json").read_text())
    assert len(raw) >= 20  # PEFT wrote its many fields, nearly all at their defaults
    adapter = load_adapter("a", plain, spec)
    assert adapter.rank == 4
    assert set(adapter.layers) == {f"layers.{i}.{m}" for i in range(spec.num_layers)
                                   for m in ("self_attn.qkv_proj", "mlp.down_proj")}
    qkv = adapter.layers["layers.0.self_attn.qkv_proj"]
    q_rows = spec.num_heads * spec.head_dim
    assert qkv.b[:q_rows].abs().sum() > 0 and qkv.b[q_rows:].abs().sum() == 0  # q only: k and v rows untouched


@pytest.mark.parametrize(("field", "value"), [
    ("use_dora", True), ("bias", "all"), ("bias", "lora_only"), ("modules_to_save", ["lm_head"]),
    ("lora_bias", True), ("fan_in_fan_out", True), ("layer_replication", [[0, 1]]), ("peft_type", "IA3"),
])
def test_math_changing_fields_are_refused_by_name(plain, spec, tmp_path, field, value):
    with pytest.raises(LoraError, match=f"{field}="):
        load_adapter("a", edited(plain, tmp_path, **{field: value}), spec)


def test_unknown_and_training_fields_are_accepted(plain, spec, tmp_path):
    adapter = load_adapter("a", edited(plain, tmp_path, lora_dropout=0.3, init_lora_weights="gaussian",
                                       some_future_field=None), spec)
    assert adapter.rank == 4


def test_modules_lockgate_lacks_are_refused(tiny_model_dir, spec, tmp_path):
    import warnings

    with warnings.catch_warnings():  # the tiny model ties its head to the embedding: peft says so
        warnings.simplefilter("ignore", UserWarning)
        lm_head = make_adapter(tiny_model_dir, tmp_path / "head", ["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="lm_head"):
        load_adapter("h", lm_head, spec)


def test_bad_folders_and_ranks(plain, spec, tmp_path):
    with pytest.raises(LoraError, match="is not a folder"):
        load_adapter("x", tmp_path / "nowhere", spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json does not exist"):
        load_adapter("x", tmp_path / "empty", spec)
    with pytest.raises(LoraError, match="above --max-lora-rank 2"):
        load_adapter("a", plain, spec, max_rank=2)
    broken = edited(plain, tmp_path)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraError, match="cannot read"):
        load_adapter("a", broken, spec)


def test_adapter_of_another_shape_is_refused(plain, tmp_path):
    from transformers import AutoConfig

    other = AutoConfig.for_model("llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(LoraError, match="do not fit the base layer"):
        load_adapter("a", plain, ModelSpec.from_hf(other), torch.float32)


def test_engine_config_refusals(tiny_model_dir, plain):
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineConfig(lora_modules=(("a", str(plain)),))
    with pytest.raises(ValueError, match="w8a8"):
        EngineConfig(enable_lora=True, quantization="w8a8")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="unique"):
        EngineConfig(enable_lora=True, lora_modules=(("a", str(plain)), ("a", str(plain))))


def test_engine_refuses_unknown_adapter_names(tiny_model_dir, plain):
    from engine_workers.engine.core import Engine

    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, enable_lora=True,
                                 lora_modules=(("a", str(plain)),)))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
        engine.add_request("r", [5, 6, 7], lora="b")
    base = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        base.add_request("r", [5, 6, 7], lora="a")
