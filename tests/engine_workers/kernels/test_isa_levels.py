"""The kernels' ISA levels (engine_workers/kernels/isa.py, cpu_kernels.py): the level chosen from the CPU's
flags, LOCKGATE_CPU_ISA checked (a bad value or a level above the CPU's refused, naming why), the
compiler flags of each level, and two levels' modules loaded side by side in one process, each
with its own code (the avx512 build's split decode path, the avx2 build's strips) and results
that agree; the amx level runs the avx512 build (one module) with oneDNN's AMX tiles on top."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_workers.kernels import cpu_kernels, lowp_kernels
from engine_workers.kernels import isa as isa_levels
from engine_workers.kernels.lowp_kernels import quantize_int8

AVX2_FLAGS = {"sse2", "avx", "avx2", "fma", "f16c"}
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AMX_FLAGS = AVX512_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


def test_host_level_is_the_best_the_flags_allow() -> None:
    assert isa_levels.host_isa(AVX512_FLAGS) == "avx512"
    assert isa_levels.host_isa(AVX2_FLAGS) == "avx2"
    assert isa_levels.host_isa(AVX2_FLAGS - {"fma"}) == "generic"
    assert isa_levels.host_isa(AVX512_FLAGS - {"avx512bw"}) == "avx2"
    assert isa_levels.host_isa(AMX_FLAGS) == "amx"
    assert isa_levels.host_isa(AMX_FLAGS - {"amx_bf16"}) == "avx512"  # tiles without bf16 products: no use here


def test_forced_level_is_checked() -> None:
    assert isa_levels.parse_isa(" AVX2 ", AVX512_FLAGS) == "avx2"
    assert isa_levels.parse_isa("amx", AMX_FLAGS) == "amx"
    assert isa_levels.parse_isa("avx512", AMX_FLAGS) == "avx512"  # a lower level on an AMX host
    with pytest.raises(ValueError, match="LOCKGATE_CPU_ISA=amx: this CPU lacks amx_tile, amx_bf16 .it can run avx512"):
        isa_levels.parse_isa("amx", AVX512_FLAGS)
    with pytest.raises(ValueError, match="LOCKGATE_CPU_ISA must be one of avx2, avx512, amx; got 'sse9'"):
        isa_levels.parse_isa("sse9", AVX512_FLAGS)
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw, avx512vl, avx512dq .it can run avx2"):
        isa_levels.parse_isa("avx512", AVX2_FLAGS)


def test_env_var_is_read_once_and_a_bad_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_isa", [])
    monkeypatch.setenv("LOCKGATE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="one of avx2, avx512, amx"):
        cpu_kernels.isa_level()
    monkeypatch.setenv("LOCKGATE_CPU_ISA", "avx2")
    if isa_levels.host_isa() in isa_levels.ISA_LEVELS:
        assert cpu_kernels.isa_level() == "avx2"
        monkeypatch.setenv("LOCKGATE_CPU_ISA", "avx512")  # decided once per process: no change
        assert cpu_kernels.isa_level() == "avx2"


def test_compiler_flags_per_level() -> None:
    avx2 = cpu_kernels.isa_cflags("avx2", AVX512_FLAGS)
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2) and not any(f.startswith("-mavx512") for f in avx2)
    assert "-march=native" not in avx2  # that would enable AVX-512 on this host
    avx512 = cpu_kernels.isa_cflags("avx512", AVX512_FLAGS)
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"} <= set(avx512)
    assert "-mavx512bf16" not in avx512  # only where the CPU has avx512_bf16
    assert "-mavx512bf16" in cpu_kernels.isa_cflags("avx512", AVX512_FLAGS | {"avx512_bf16"})
    # the amx level is its own build: the avx512 flags plus the AMX tiles' (its tile GEMM, csrc/amx_bf16.cpp)
    amx = cpu_kernels.isa_cflags("amx", AMX_FLAGS)
    assert {"-mamx-tile", "-mamx-bf16", "-mavx512bf16"} <= set(amx)
    assert set(amx) - {"-mamx-tile", "-mamx-bf16"} == set(cpu_kernels.isa_cflags("avx512", AMX_FLAGS))
    assert not any(f.startswith("-mamx") for f in cpu_kernels.isa_cflags("avx512", AMX_FLAGS))


@pytest.mark.skipif(isa_levels.host_isa() != "amx", reason="needs an AMX host")
def test_amx_level_has_its_own_module_with_the_tile_kernel() -> None:
    try:
        assert cpu_kernels.use_isa("avx512") == "avx512"
        assert cpu_kernels.problem() is None
        avx512 = cpu_kernels._module()[0]
        assert cpu_kernels.use_isa("amx") == "amx"
        assert cpu_kernels.problem() is None
        amx = cpu_kernels._module()[0]
        assert amx is not avx512 and amx.__name__ == "lockgate_cpu_kernels_amx"
        assert amx.amx_bf16_built() and not avx512.amx_bf16_built()  # the stub without -mamx-*
    finally:
        cpu_kernels.use_isa(None)


@pytest.mark.skipif(isa_levels.host_isa() not in ("avx512", "amx"), reason="needs a host that runs both levels")
def test_both_levels_load_side_by_side_with_their_own_code() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(200, 300, generator=gen), torch.randn(200, generator=gen), torch.randn(13, 300, generator=gen)
    q, s = quantize_int8(w)
    scales = torch.zeros(-(-200 // lowp_kernels.LOWP_PANEL_COLS) * lowp_kernels.LOWP_PANEL_COLS)
    scales[:200] = s
    got, dirs = {}, {}
    try:
        for level in ("avx2", "avx512"):
            assert cpu_kernels.use_isa(level) == level
            assert cpu_kernels.problem() is None and lowp_kernels.lowp_problem() is None
            module = cpu_kernels._module()[0]
            assert module.__name__ == f"lockgate_cpu_kernels_{level}"
            dirs[level] = Path(module.__file__).parent.name
            # the split decode path exists in the avx512 build only: each module runs its own code
            assert bool(module.paged_decode_splits(64)) == (level == "avx512")
            ops = lowp_kernels.lowp()
            assert ops is not None
            got[level] = (ops.linear_i8(x, ops.pack_i8(q), scales, 200, b), ops.linear_bf16(x, ops.pack_bf16(w), 200, b))
    finally:
        cpu_kernels.use_isa(None)
    # each level loaded from the build directory a fresh process computes for it (a key changed
    # by the first load, e.g. load() extending the ldflags list, rebuilt the second level once per process)
    fresh = subprocess.run([sys.executable, "-c", "from engine_workers.kernels import cpu_kernels as k; "
                            "print(k._build_dir('avx2').name, k._build_dir('avx512').name)"],
                           capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert fresh == [dirs["avx2"], dirs["avx512"]]
    # each column sums over k in the same order, one FMA per k, in both builds
    for a, c in zip(got["avx2"], got["avx512"], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
