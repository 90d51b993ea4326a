"""bf16 linears on AMX tiles (engine_workers/kernels/amx_linear.py) and ``--dtype auto`` on a CPU: the
layer against F.linear of the bf16-rounded operands, the load-time batch-invariance check finding a
row-count-dependent kernel, the refusals (ISA level below amx, oneDNN capped below AMX) naming why,
and the engine's automatic choice. Batch invariance of the layer itself, alone and through a whole
model, is in test_cpu_linear.py (its bf16 mode is this layer at the amx level)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import amx_linear, cpu_kernels
from engine_workers.kernels import isa as isa_levels
from engine_workers.kernels.amx_linear import AMX_ROWS, AmxLinear
from engine_workers.kernels.cpu_linear import auto_cpu_dtype, auto_kv_cache_dtype

needs_amx = pytest.mark.skipif(isa_levels.host_isa() != "amx", reason="needs a CPU with AMX tiles (amx_bf16)")
needs_onednn = pytest.mark.skipif(amx_linear._ops() is None, reason="this torch build has no oneDNN linear ops")


@pytest.fixture
def amx_level():
    try:
        assert cpu_kernels.use_isa("amx") == "amx"
        yield
    finally:
        cpu_kernels.use_isa(None)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, AMX_ROWS, AMX_ROWS + 1, 3 * AMX_ROWS + 7])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_is_f_linear_of_the_bf16_operands(amx_level, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 300, generator=gen) * 0.05, torch.randn(2, rows, 300, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    assert amx_linear.amx(), amx_linear.amx_problem()
    lin = AmxLinear.from_weight(w, b)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (2, rows, 200)
    product = F.linear(x.bfloat16().float(), w.bfloat16().float())
    want = product if b is None else product + b
    # float32 sums of bf16 products, the product rounded to bf16 once (half an ulp: 2^-9 of it),
    # the bias added after in float32
    assert ((got - want).abs() <= product.abs() * 2 ** -8 + 1e-5).all(), (got - want).abs().max()
    assert lin.weight_bytes() == 200 * 300 * 2


@needs_onednn
def test_shape_check_finds_a_kernel_whose_sums_depend_on_the_row_count(monkeypatch):
    reorder, linear = amx_linear._ops()

    def by_rows(x, packed, bias, *rest):  # a kernel that, like oneDNN's above 32 rows, sums another way
        y = linear(x, packed, bias, *rest)
        return y + (x.shape[0] > 3) * 2.0 ** -6 * y

    monkeypatch.setattr(amx_linear, "_shape_checks", {})
    monkeypatch.setattr(amx_linear, "_ops", lambda: (reorder, by_rows))
    monkeypatch.setattr(amx_linear, "tiles", lambda: None)  # the oneDNN path's check
    why = amx_linear.shape_problem(64, 96)
    assert why is not None and "64x96 weight" in why and "differs from the row alone" in why
    monkeypatch.setattr(amx_linear, "_ops", lambda: (reorder, linear))
    monkeypatch.setattr(amx_linear, "_shape_checks", {})
    assert amx_linear.shape_problem(64, 96) is None


@needs_amx
def test_a_layer_whose_shape_fails_the_check_keeps_the_engines_bf16_kernel(amx_level, monkeypatch, caplog):
    from engine_workers.kernels.cpu_linear import LowpLinear, bf16_layer, lowp_problem

    if lowp_problem("bfloat16") is not None:
        pytest.skip(lowp_problem("bfloat16"))
    monkeypatch.setattr(amx_linear, "shape_problem", lambda n, k: f"{n}x{k} weight: row 3 differs")
    with caplog.at_level(logging.WARNING):
        lin = bf16_layer(torch.randn(48, 40), None)
    assert isinstance(lin, LowpLinear)
    assert "bf16 layer off AMX tiles" in caplog.text and "48x40 weight: row 3 differs" in caplog.text


def test_amx_is_refused_below_the_amx_level_and_under_a_onednn_cap(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "isa_level", lambda: "avx512")
    assert amx_linear._resolve() == (None, "ISA level avx512, not amx")
    monkeypatch.setattr(cpu_kernels, "isa_level", lambda: "amx")
    monkeypatch.setitem(cpu_kernels._state, "amx_tiles", None)  # the cap is oneDNN's: without the tile kernel
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert amx_linear._resolve() == (None, "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps oneDNN off the AMX tiles")


def test_auto_picks_bf16_only_where_it_runs_on_amx(monkeypatch):
    monkeypatch.setattr(amx_linear, "amx", lambda: True)
    dtype, why = auto_cpu_dtype("none")
    assert dtype == torch.bfloat16 and "AMX" in why
    assert auto_cpu_dtype("w8a8")[0] == torch.float32  # quantizations compute in float32 around their linears
    assert auto_cpu_dtype("none", cpu_kernels=False) == (torch.float32, "--no-cpu-kernels: oneDNN float32 linears")
    monkeypatch.setattr(amx_linear, "amx", lambda: False)
    monkeypatch.setattr(amx_linear, "amx_problem", lambda: "ISA level avx512, not amx")
    dtype, why = auto_cpu_dtype("none")
    assert dtype == torch.float32 and "ISA level avx512, not amx" in why


def test_auto_kv_cache_is_bf16_only_with_bf16_linears_on_amx(monkeypatch):
    monkeypatch.setattr(amx_linear, "amx", lambda: True)
    kv, why = auto_kv_cache_dtype("auto", "bfloat16")
    assert kv == "bfloat16" and why is not None and "AMX" in why
    # an explicit choice stays; other weight formats (float32 = None, quantized) keep the compute dtype
    assert auto_kv_cache_dtype("float32", "bfloat16") == ("float32", None)
    assert auto_kv_cache_dtype("auto", None) == ("auto", None)
    assert auto_kv_cache_dtype("auto", "w8a8") == ("auto", None)
    monkeypatch.setattr(amx_linear, "amx", lambda: False)  # bf16 weights widened in registers: no AMX
    assert auto_kv_cache_dtype("auto", "bfloat16") == ("auto", None)


@needs_amx
def test_engine_with_no_precision_flags_runs_bf16_on_amx_and_says_why(amx_level, tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO):
        eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_bytes=8 << 20))
    assert eng.config.dtype == "auto"
    assert eng.weight_format == "bfloat16" and eng.dtype == torch.float32  # bf16 linears, float32 elsewhere
    assert any(isinstance(m, AmxLinear) for m in eng.loaded.model.modules())
    assert "--dtype auto on this CPU: bfloat16 (AMX tiles" in caplog.text
    assert eng.kv_dtype == torch.bfloat16 and "--kv-cache-dtype auto on this CPU: bfloat16" in caplog.text
    explicit = Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_bytes=8 << 20, kv_cache_dtype="float32"))
    assert explicit.weight_format == "bfloat16" and explicit.kv_dtype == torch.float32


def test_engine_below_the_amx_level_keeps_float32_by_default(tiny_model_dir):
    level = isa_levels.host_isa()
    if level not in ("avx512", "amx"):
        pytest.skip("the check runs at the avx512 level")
    try:
        cpu_kernels.use_isa("avx512")
        eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_bytes=8 << 20))
    finally:
        cpu_kernels.use_isa(None)
    assert eng.weight_format == "float32"
