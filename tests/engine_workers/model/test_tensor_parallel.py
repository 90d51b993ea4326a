"""Tensor parallelism on CPU (engine_workers/model/execution/parallel): greedy tokens at TP=2 equal TP=1 token
for token for the default model and a tiny random checkpoint of each supported family, per-rank KV
bytes per block follow the head split, what cannot be split is refused by field, and a rank that
dies makes rank 0 fail fast with a clear error.

The TP=2 engines share one group (one child process, loading each model in turn) to spare a
process start per model; the kill test breaks its group, and the next user gets a fresh one."""

from __future__ import annotations

import random
import time

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.parallel import step as step_codec
from engine_workers.model.execution.parallel.group import TpGroup
from engine_workers.model.execution.runner import kv_block_bytes
from engine_workers.model.loading.sharding.layout import TensorParallelError, even_ranges, head_split, rank_layout
from engine_workers.model.loading.sharding.shard import local_spec
from lockgate_types import SamplingParams
from tests.engine_workers.model import test_families as families

SMALL = dict(vocab_size=515, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=3, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             rms_norm_eps=1e-5)
MOE = dict(num_experts_per_tok=2)
# vocab 515 and 3 KV heads: the uneven splits (vocab padded, KV heads 2 + 1) on every family
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict()),  # q/k/v biases
    "qwen3": ("qwen3", dict()),  # per-head q/k norms
    "mistral-window": ("mistral", dict(sliding_window=24)),
    "gemma2": ("gemma2", dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0)),
    "phi3": ("phi3", dict(pad_token_id=0)),  # fused qkv and gate_up in the checkpoint
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=24, norm_topk_prob=True,
                                    mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(MOE, num_local_experts=4)),
    "gpt_oss": ("gpt_oss", dict(MOE, num_local_experts=4, sliding_window=24,
                                layer_types=["sliding_attention", "full_attention"])),  # sinks, biases
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def save(name: str, out):
    return families.save(name, out, FAMILIES, SMALL)


class Groups:
    """One live TP=2 group for the module, started again if a test broke it."""

    def __init__(self) -> None:
        self.group: TpGroup | None = None

    def get(self) -> TpGroup:
        if self.group is not None:
            try:
                self.group.check()
            except TensorParallelError:
                pass
        if self.group is None or self.group.broken is not None:
            if self.group is not None:
                self.group.close()
            self.group = TpGroup(2)
        return self.group


@pytest.fixture(scope="module")
def groups():
    g = Groups()
    yield g
    if g.group is not None:
        g.group.close()


def both(path: str, groups: Groups, prompts, **cfg) -> tuple[Engine, Engine]:
    one = Engine(EngineConfig(model=path, **cfg))
    two = Engine(EngineConfig(model=path, tensor_parallel_size=2, **cfg), tp_group=groups.get())
    return one, two


# -- layout, as pure arithmetic ------------------------------------------------------------------

def test_gqa_groups_split_whole_and_unevenly():
    # SmolLM2-135M: 9 query heads in 3 groups; rank 0 two groups, rank 1 one
    assert head_split(9, 3, 2) == (((0, 6), (0, 2)), ((6, 9), (2, 3)))
    assert head_split(32, 8, 4) == tuple(((8 * r, 8 * r + 8), (2 * r, 2 * r + 2)) for r in range(4))
    # fewer KV heads than ranks: each replicated on 2 ranks, its query heads split between them
    assert head_split(8, 2, 4) == (((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2)))
    with pytest.raises(TensorParallelError, match="num_key_value_heads=3"):
        head_split(9, 3, 4)
    assert even_ranges(1536, 2) == ((0, 768), (768, 1536)) and even_ranges(5, 2) == ((0, 3), (3, 5))


def test_step_inputs_round_trip():
    chunks = [([5, 6, 7], 0, [3, 1], True), ([9], 40, [0, 2, 4], True), ([1, 2], 16, [7, 8], False)]
    plain = [step_codec.PLAIN] * 3
    for every_row in (False, True):
        assert step_codec.decode(step_codec.encode(chunks, every_row)) == (chunks, every_row, plain)
    # verify, replay and one-token prefill chunks travel as such: the followers attend them as
    # rank 0 does and take the same logit rows
    chunks.append(([4], 17, [7, 8], False))  # a prompt's last token alone: a prefill row
    batch = ModelInput(tuple(Chunk(*c) for c in chunks), verify=(1,), replay=(2,), prefill=(3,))
    modes = step_codec.modes_of(batch)
    assert modes == [step_codec.PLAIN, step_codec.VERIFY, step_codec.REPLAY, step_codec.PREFILL]
    again = step_codec.model_input(*step_codec.decode(step_codec.encode(batch.chunks, False, modes)))
    assert again == batch and again.decode_rows == {1, 2}


# -- equality with TP=1 --------------------------------------------------------------------------

def test_default_model_tp2_equals_tp1_and_kv_per_rank(default_model_dir, groups):
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a wise old owl who "
               "knew every path through the forest and every song the river sang; one morning"]
    one, two = both(default_model_dir, groups, prompts, kv_cache_bytes=8 << 20)
    want = [list(o.token_ids) for o in one.generate(prompts, GREEDY)]
    assert [list(o.token_ids) for o in two.generate(prompts, GREEDY)] == want
    # again: prefix-cache hits on every rank's own cache
    again = two.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in again] == want and max(o.num_cached_tokens for o in again) > 0
    # per-rank KV bytes per block: rank 0 holds 2 of the 3 KV heads, rank 1 one; the ranks add up to TP=1
    spec = one.runner.spec
    full = kv_block_bytes(spec, 16, torch.float32)
    r0 = kv_block_bytes(two.runner.spec, 16, torch.float32)
    r1 = kv_block_bytes(local_spec(spec, rank_layout(spec, 1, 2)), 16, torch.float32)
    assert (r0 * 3, r1 * 3) == (full * 2, full) and r0 + r1 == full
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in two.runner.kv_caches)
    assert allocated == r0 * two.runner.num_blocks
    # the same per-rank budget holds more blocks at TP=2
    assert two.runner.num_blocks > one.runner.num_blocks


def test_kv_bytes_per_block_halve_with_an_even_split(tmp_path, groups):
    path = str(_even_llama(tmp_path))
    one, two = both(path, groups, [], kv_cache_bytes=1 << 20, block_size=8)
    assert kv_block_bytes(two.runner.spec, 8, torch.float32) * 2 == kv_block_bytes(one.runner.spec, 8, torch.float32)
    assert two.runner.num_blocks == 2 * one.runner.num_blocks


def _even_llama(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    config = AutoConfig.for_model("llama", **{**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2})
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    out = tmp_path / "even"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tp2_equals_tp1(name, tmp_path, groups):
    path = str(save(name, tmp_path / name))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 37)]  # 37: past the 24-token window
    one, two = both(path, groups, prompts, kv_cache_bytes=2 << 20, block_size=8)
    want = [list(o.token_ids) for o in one.generate(prompts, GREEDY)]
    assert [list(o.token_ids) for o in two.generate(prompts, GREEDY)] == want, name


def test_unsplittable_refused_naming_field(tmp_path, groups):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    config = AutoConfig.for_model("olmo2", **SMALL)  # q/k norms over every head at once
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "olmo2")
    tok.save_pretrained(tmp_path / "olmo2")
    with pytest.raises(Exception, match="q_norm/k_norm span every head"):
        Engine(EngineConfig(model=str(tmp_path / "olmo2"), tensor_parallel_size=2, kv_cache_bytes=1 << 20),
               tp_group=groups.get())
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


# -- failure ---------------------------------------------------------------------------------------

def test_killed_rank_fails_rank0_fast_with_a_clear_error(tiny_model_dir, groups):
    group = groups.get()
    engine = Engine(EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, kv_cache_bytes=1 << 20),
                    tp_group=group)
    assert [len(o.token_ids) for o in engine.generate(["hello"], GREEDY)] == [12]
    group.procs[0].kill()
    group.procs[0].wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 of 2 exited with code -9"):
        engine.generate(["hello again"], GREEDY)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError):  # broken for good: every later step says so at once
        engine.generate(["once more"], GREEDY)


def test_flag_on_every_engine_command_with_env_twin(monkeypatch):
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    for cmd in (["serve"], ["worker"], ["bench", "engine"], ["generate", "hi"]):
        assert engine_config_from_args(build_parser().parse_args(cmd)).tensor_parallel_size == 1, cmd
        args = build_parser().parse_args([*cmd[:-1], "--tensor-parallel-size", "2", *cmd[-1:]] if cmd[0] == "generate"
                                         else [*cmd, "--tensor-parallel-size", "2"])
        assert engine_config_from_args(args).tensor_parallel_size == 2, cmd
    monkeypatch.setenv("LOCKGATE_TENSOR_PARALLEL_SIZE", "3")
    assert engine_config_from_args(build_parser().parse_args(["serve"])).tensor_parallel_size == 3


def test_cuda_without_devices_refused(tiny_model_dir):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has 2 CUDA devices")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 on CUDA needs 2 devices; torch sees \d"):
        Engine(EngineConfig(model=tiny_model_dir, device="cuda", tensor_parallel_size=2))
