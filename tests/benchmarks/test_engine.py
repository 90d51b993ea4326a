"""`lockgate bench engine` on the tiny model: every engine (lockgate, its no-kernels ablation, HF
static, HF continuous) runs the whole workload in a process of its own after the same warm-up,
--repeat keeps each one's best, the engine flags reach lockgate and --dtype the HF rows, the KV
capacity is against a prompt + max_tokens reservation, and the workload is the anchors'."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from benchmarks.engine.bench import Workload, capacity, make_workload, model_flops
from benchmarks.engine.hf_baselines import hf_precision, load_model
from benchmarks.machine import MACHINE_FLAGS, machine_info
from engine_workers.engine.config import EngineConfig
from lockgate.cli import build_parser


@pytest.fixture(scope="module")
def bench(tiny_model_dir) -> dict:
    """One run of every row, shared by the tests below (each engine process costs seconds to start).
    bfloat16: HF runs the model in bf16 on any CPU; lockgate has bf16 weights where its kernels can.
    Seed 167: three requests of 15, 27 and 10 output tokens, the shortest draw (the tiny model in
    bf16 steps slowly in HF)."""
    args = build_parser().parse_args(["bench", "engine", "--model", tiny_model_dir, "--kv-cache-bytes", "16M",
                                      "--block-size", "8", "--num-requests", "3", "--seed", "167", "--repeat", "2",
                                      "--dtype", "bfloat16", "--json"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert args.func(args) == 0
    return json.loads(buf.getvalue())


def test_bench_engine_names_the_machine_and_records_engine_flags(bench):
    m = bench["machine"]
    for key in ("cpu_model", "cpu_flags", "cpu_count", "usable_cores", "clock_mhz_at_start", "max_clock_mhz", "torch",
                "onednn", "loadavg_1_5_15_at_start", "loadavg_1_5_15_at_end"):
        assert key in m
    from engine_workers.kernels.cpu_kernels import isa_level

    assert m["kernel_isa"] == isa_level()  # the kernels' ISA level, next to the CPU model
    # every engine flag is recorded, and reached the engine (block size 8 in its KV cache)
    assert bench["engine_config"]["block_size"] == 8 == bench["capacity"]["block_size"]
    assert bench["engine_config"]["kv_cache_bytes"] == 16 << 20 and bench["engine_config"]["dtype"] == "bfloat16"
    assert bench["prompt_tokens"] == sum(len(p) for p in make_workload(512, 3, 167).prompts)


def test_bench_engine_lockgate_and_its_ablation_keep_best_of_rounds(bench):
    assert bench["repeat"] == 2
    for key, kernels in (("lockgate", True), ("lockgate_ablation", False)):
        row = bench[key]
        assert row["weight_prepack"] is kernels and row["cpu_kernels"] is kernels
        assert len(row["all_seconds"]) == 2 and row["seconds"] == min(row["all_seconds"])
        assert row["warmup_s"] > 0 and row["threads"] == bench["threads"]
        # every round computes every prompt: no round is made cheaper by an earlier round's prefix cache
        assert row["computed_tokens"] == bench["prompt_tokens"] + bench["output_tokens"] - bench["requests"]
    assert bench["lockgate_ablation"]["weights"] == "float32"  # low-precision weights are kernels too
    assert bench["speedup_vs_lockgate_ablation"] == pytest.approx(
        bench["lockgate_ablation"]["seconds"] / bench["lockgate"]["seconds"])
    assert f"{bench['lockgate']['seconds']:.2f}" in bench["table_row"]
    assert set(bench["gemm_flops_by_path"]) >= {"torch_mm"}
    assert bench["gemm_flops"] == max(bench["gemm_flops_by_path"].values())
    share = bench["lockgate"]["roofline_share"]
    assert 0 < share == pytest.approx(bench["lockgate"]["model_flops_per_s"] / bench["gemm_flops"])


def test_bench_engine_hf_rows_warm_up_and_follow_dtype(bench):
    for key in ("hf_static_b8", "hf_continuous"):
        row = bench[key]
        assert len(row["all_seconds"]) == 2 and row["seconds"] == min(row["all_seconds"])
        assert row["warmup_s"] > 0  # the same warm-up as lockgate's, before the timed runs
        assert row["threads"] == bench["threads"] == bench["lockgate"]["threads"]
        assert row["dtype"] == "bfloat16" and row["precision"].startswith("bfloat16 throughout")
        assert bench[f"speedup_vs_{key}"] == pytest.approx(row["seconds"] / bench["lockgate"]["seconds"])
    # transformers' continuous batching gets lockgate's KV budget, not its default share of host RAM
    assert bench["hf_continuous"]["kv_tokens"] >= bench["capacity"]["kv_tokens"]


def test_bench_engine_rejects_repeat_below_one(tiny_model_dir):
    args = build_parser().parse_args(["bench", "engine", "--model", tiny_model_dir, "--repeat", "0", "--skip-hf"])
    with pytest.raises(ValueError, match="--repeat"):
        args.func(args)


def test_workload_is_the_anchors():
    # shared/anchors/README.md, "Workload": 32 requests of seed 0 over SmolLM2's 49152 ids
    wl = make_workload(49152, 32, 0)
    assert (wl.prompt_tokens, wl.output_tokens) == (4146, 1389)
    assert wl.fingerprint() == "aab3167ce97ad994"  # llama.cpp anchor's workload_sha256_16
    assert all(8 <= len(p) <= 256 and min(p) >= 3 for p in wl.prompts) and all(8 <= m <= 96 for m in wl.outputs)


def test_kv_capacity_is_against_prompt_plus_max_tokens():
    wl = Workload(prompts=[[5] * 10, [5] * 20], outputs=[7, 4])  # 17 and 24 tokens: 2 blocks of 16 each
    c = capacity(wl, num_blocks=10, block_size=16, max_model_len=64)
    assert c["kv_tokens"] == 160 and c["mean_sequence_tokens"] == 20.5 and c["mean_sequence_blocks"] == 2
    assert c["paged_sequences"] == 10 // 2 == 5
    assert c["contiguous_sequences"] == 160 * 2 // (17 + 24) == 7  # reservation of prompt + max_tokens each
    assert c["ratio"] == pytest.approx(5 / 7)
    assert c["contiguous_sequences_at_max_model_len"] == 160 // 64


def test_hf_precision_follows_dtype_where_transformers_can():
    assert hf_precision(EngineConfig(), "cpu") == ("float32", "float32")
    assert hf_precision(EngineConfig(), "cuda") == ("bfloat16", "bfloat16")
    dtype, note = hf_precision(EngineConfig(dtype="bfloat16"), "cpu")
    assert dtype == "bfloat16" and "throughout" in note
    dtype, note = hf_precision(EngineConfig(quantization="int8"), "cpu")
    assert dtype == "float32" and "HF lacks int8" in note


def test_hf_model_loads_in_the_dtype_asked(tiny_model_dir):
    import torch

    model = load_model(tiny_model_dir, "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id is None


def test_machine_info_names_the_machine():
    m = machine_info()
    assert m["cpu_count"] >= 1 and m["torch"]
    assert m["cpu_flags"] is None or set(m["cpu_flags"]) == set(MACHINE_FLAGS)


def test_model_flops_counts_attention_exactly():
    spec = SimpleNamespace(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, intermediate_size=16,
                           num_layers=3, vocab_size=100)
    per_layer = 2 * 8 * (4 + 2 * 2) * 2 + 2 * 4 * 2 * 8 + 2 * 3 * 8 * 16
    # one sequence of final length 4 computes positions 0..2, attending to 1, 2 and 3 keys
    want = 3 * 3 * per_layer + 4 * 4 * 2 * (1 + 2 + 3) * 3 + 1 * 2 * 8 * 100
    assert model_flops(spec, computed_tokens=3, sampled_tokens=1, seq_lens=[4]) == want
