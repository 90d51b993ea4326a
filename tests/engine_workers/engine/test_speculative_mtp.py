"""Speculative decoding from a checkpoint's own MTP module (DeepSeek-V3's num_nextn_predict_layers):
a tiny random DeepSeek-V3 with one MTP module written after its layers; the module's weights are
loaded (not ignored), it proposes from the target's hidden states, and every request's tokens are
those of plain decoding, greedy and seeded, alone and in mixed batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.engine.mtp import MtpProposer
from engine_workers.engine.speculative import SpeculativeConfig
from engine_workers.model.loading.loader import load_model, load_mtp
from engine_workers.model.models.mtp import MtpForPagedLM
from lockgate_types import SamplingParams
from tests.engine_workers.model.test_deepseek import save
from tokenization.model_store import ModelError

CPU = torch.device("cpu")
MTP = SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3}')


def add_mtp_module(path) -> None:
    """Write DeepSeek-V3's MTP module ``model.layers.{L}.*`` into the checkpoint: a decoder layer
    (the last layer's weights plus noise: MLA and MoE like the model's), random enorm / hnorm /
    eh_proj, and the shared head (the model's final norm and head, as DeepSeek-V3 stores them)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    (weights,) = path.glob("*.safetensors")
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(3)
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name in [k for k in state if k.startswith(src)]:
        t = state[name]
        state[dst + name.removeprefix(src)] = t + (0.02 * torch.randn(t.shape, generator=gen) if t.is_floating_point()
                                                   else 0)
    state[dst + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state[dst + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state[dst + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=gen)
    state[dst + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[dst + "shared_head.norm.weight"] = state["model.norm.weight"].clone()
    state[dst + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    path = save("q_lora-yarn", tmp_path_factory.mktemp("deepseek-mtp") / "m")
    add_mtp_module(path)
    return path


@pytest.fixture(scope="module")
def engines(mtp_dir):
    base = dict(model=str(mtp_dir), kv_cache_bytes=2 << 20, block_size=8)
    return Engine(EngineConfig(**base)), Engine(EngineConfig(**base, speculative_config=MTP))


def test_the_mtp_module_is_loaded_from_the_checkpoint(mtp_dir):
    loaded = load_model(str(mtp_dir), torch.float32, CPU)
    mtp = load_mtp(loaded, torch.float32, CPU)
    assert isinstance(mtp.model, MtpForPagedLM) and mtp.spec.num_layers == 1
    from safetensors.torch import load_file

    (weights,) = mtp_dir.glob("*.safetensors")
    state = load_file(str(weights))
    assert torch.equal(mtp.model.eh_proj.weight, state["model.layers.3.eh_proj.weight"])
    assert torch.equal(mtp.model.norm.weight, state["model.layers.3.shared_head.norm.weight"])
    assert mtp.model.lm_head is not None
    assert torch.equal(mtp.model.lm_head.weight, state["model.layers.3.shared_head.head.weight"])
    # its decoder layer is the module's, not the model's last one
    assert not torch.equal(mtp.model.layers[0].input_layernorm.weight,
                           loaded.model.layers[2].input_layernorm.weight)
    assert torch.equal(mtp.model.layers[0].input_layernorm.weight, state["model.layers.3.input_layernorm.weight"])


def test_a_checkpoint_without_mtp_layers_is_refused_by_name(tmp_path):
    path = save("q_proj-half", tmp_path / "plain")
    with pytest.raises(ModelError, match="num_nextn_predict_layers"):
        Engine(EngineConfig(model=str(path), kv_cache_bytes=2 << 20, speculative_config=MTP))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1  # said, but not stored
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="lack the MTP module"):
        Engine(EngineConfig(model=str(path), kv_cache_bytes=2 << 20, speculative_config=MTP))


def test_mtp_tokens_equal_plain_decoding(engines):
    plain, spec = engines
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33, 12)]
    prompts[3] = [40, 41, 42, 43] * 5
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=40, top_p=0.9, seed=5),
              SamplingParams(max_tokens=24, temperature=0.3, seed=1, ignore_eos=True)]
    want = [plain.generate([p], [q])[0] for p, q in zip(prompts, params)]
    together = spec.generate(prompts, params)
    alone = [spec.generate([p], [q])[0] for p, q in zip(prompts, params)]
    for i, (w, t, a) in enumerate(zip(want, together, alone)):
        assert t.token_ids == w.token_ids and t.finish_reason == w.finish_reason, f"request {i} in a batch"
        assert a.token_ids == w.token_ids, f"request {i} alone"
    assert isinstance(spec.draft, MtpProposer)
    st = spec.stats
    assert st.spec_num_drafts > 0 and spec.draft.forwards > 0
    assert spec.draft.num_tracked() == 0 and spec.draft.kv.num_free_blocks == spec.draft.kv.num_blocks


def test_mtp_proposals_follow_the_target_states(engines):
    """The module reads the target's states: the same tokens with other states propose otherwise."""
    _, spec = engines
    assert isinstance(spec.draft, MtpProposer)
    model = spec.draft.model
    ids = torch.tensor([7, 8, 9])
    model.prev_hidden = torch.zeros(3, model.spec.hidden_size)
    a = model.embed(ids)
    model.prev_hidden = torch.ones(3, model.spec.hidden_size)
    b = model.embed(ids)
    model.prev_hidden = None
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="prev_hidden"):
        model.embed(ids)
