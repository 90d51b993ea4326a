"""The engine's AMX tile bf16 GEMM (csrc/amx_bf16.cpp, engine_workers/kernels/amx_linear.py): its
products against float64 of the bf16-rounded operands over tails of M, N and K, a row's result bit
for bit the same alone and inside calls of every row count at several positions and thread counts,
the layer on it, its refusals and its fallback to oneDNN. Needs an AMX host (amx_bf16) for the
kernel itself; the refusals run everywhere."""

from __future__ import annotations

import pytest
import torch

from engine_workers.kernels import amx_linear, cpu_kernels
from engine_workers.kernels import isa as isa_levels
from engine_workers.kernels.amx_linear import AmxLinear

needs_amx = pytest.mark.skipif(isa_levels.host_isa() != "amx", reason="needs a CPU with AMX tiles (amx_bf16)")


@pytest.fixture
def tiles():
    try:
        assert cpu_kernels.use_isa("amx") == "amx"
        ops = amx_linear.tiles()
        assert ops is not None, amx_linear.tiles_problem()
        yield ops
    finally:
        cpu_kernels.use_isa(None)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the bf16-rounded operands (+ bias) and the sum of |products| per element."""
    xd, wd = x.bfloat16().double(), w.bfloat16().double()
    want = xd @ wd.T + (0 if b is None else b.double())
    return want, xd.abs() @ wd.abs().T + (0 if b is None else b.double().abs())


@needs_amx
@pytest.mark.parametrize(("m", "n", "k"), [
    (1, 16, 32),      # one tile, no tails
    (1, 1, 1),        # everything a tail
    (15, 31, 33),     # rows under one tile, a column and a k tail
    (16, 32, 64),     # exact tiles
    (17, 48, 40),     # a second row tile of one row; half a column block past N
    (31, 100, 70),
    (32, 576, 576),
    (33, 200, 130),   # a 1-row tail block
    (65, 192, 576),
    (300, 96, 1536),
])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_kernel_is_the_bf16_product_in_float32(tiles, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = tiles.linear(x, tiles.pack(w), n, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want, scale = _want(x, w, b)
    # bf16 x bf16 products are exact in float32: the only error is float32 summation over k
    # (k roundings of at most 2^-24 of the running sum of |products|), and the bias's addition
    err = (got.double() - want).abs()
    assert (err <= scale * (k + 1) * 2.0 ** -24).all(), (err / scale).max()
    # and not bf16-rounded output: most elements far closer than a bf16 ulp (2^-8 relative)
    assert (err <= want.abs() * 2.0 ** -12 + scale * 2.0 ** -20).float().mean() > 0.99


@needs_amx
@pytest.mark.parametrize("nthreads", [1, 2])
def test_a_rows_result_is_the_same_alone_and_in_every_batch(tiles, threads, nthreads):
    torch.set_num_threads(nthreads)
    gen = torch.Generator().manual_seed(nthreads)
    n, k, rows = 200, 130, 300
    packed = tiles.pack(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    alone = torch.cat([tiles.linear(x[r:r + 1], packed, n, None) for r in range(rows)])
    for m in range(1, rows + 1):
        for start in sorted({0, (rows - m) // 2, rows - m, (m * 7) % (rows - m + 1)}):
            got = tiles.linear(x[start:start + m].contiguous(), packed, n, None)
            assert torch.equal(got, alone[start:start + m]), f"M={m} at row {start}, {nthreads} threads"


@needs_amx
def test_thread_count_does_not_change_a_result(tiles, threads):
    gen = torch.Generator().manual_seed(5)
    n, k = 1536, 576
    packed, x = tiles.pack(torch.randn(n, k, generator=gen)), torch.randn(257, k, generator=gen)
    torch.set_num_threads(1)
    one = tiles.linear(x, packed, n, None)
    torch.set_num_threads(2)
    assert torch.equal(tiles.linear(x, packed, n, None), one)


@needs_amx
def test_the_layer_runs_on_the_tile_kernel_in_one_call_at_any_row_count(tiles):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(200, 300, generator=gen) * 0.05, torch.randn(200, generator=gen)
    lin = AmxLinear.from_weight(w, b)
    assert amx_linear.backend() == "tiles" and "tile kernel" in repr(lin)
    x = torch.randn(2, 77, 300, generator=gen)
    got = lin(x)
    want, scale = _want(x.reshape(-1, 300), w, b)
    assert got.shape == (2, 77, 200)
    assert ((got.reshape(-1, 200).double() - want).abs() <= scale * 301 * 2.0 ** -24).all()
    assert torch.equal(lin(x[1, 5:6]), got[1, 5:6])
    assert amx_linear.shape_problem(200, 300) is None  # by construction: no oneDNN row-count check


@needs_amx
def test_tile_kernel_rejects_mismatched_inputs(tiles):
    packed = tiles.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="another shape"):
        tiles.linear(torch.randn(3, 96), packed, 40, None)
    with pytest.raises(RuntimeError, match="another shape"):
        tiles.linear(torch.randn(3, 64), packed, 70, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        tiles.linear(torch.randn(3, 64).double(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        tiles.linear(torch.randn(3, 64), packed, 40, torch.randn(39))
    assert tiles.linear(torch.randn(0, 64), packed, 40, None).shape == (0, 40)


def test_check_refuses_a_kernel_whose_rows_depend_on_the_batch():
    def pack(w):
        return w

    def by_rows(x, w, n, bias):  # right products, but a row's sum shifts with the row count
        y = x.bfloat16().double() @ w.bfloat16().double().T
        return (y * (1 + 1e-7 * (x.shape[0] > 1)) + (0 if bias is None else bias.double())).float()

    why = amx_linear.check_tiles(amx_linear.TileOps(pack, by_rows))
    assert why is not None and "differs from the row alone" in why
    assert "built without AMX tiles" in amx_linear.check_tiles(None)

    def wrong(x, w, n, bias):
        return by_rows(x, w, n, bias) * 1.01

    assert "disagrees with the bf16 product" in amx_linear.check_tiles(amx_linear.TileOps(pack, wrong))


def test_tiles_are_refused_below_the_amx_level_and_on_request(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "isa_level", lambda: "avx512")
    assert amx_linear._resolve_tiles() == (None, "ISA level avx512, not amx")
    monkeypatch.setenv(amx_linear.ONEDNN_ENV, "1")
    assert amx_linear._resolve_tiles() == (None, f"{amx_linear.ONEDNN_ENV}=1")


@needs_amx
def test_onednn_stays_the_fallback_where_the_tile_kernel_is_refused(monkeypatch):
    # a fresh level state (as a new process would have), with the tile kernel asked off
    monkeypatch.setenv(amx_linear.ONEDNN_ENV, "1")
    monkeypatch.setattr(cpu_kernels, "_states", {})
    monkeypatch.setattr(cpu_kernels, "_state", {})
    try:
        assert cpu_kernels.use_isa("amx") == "amx"
        assert amx_linear.amx() and amx_linear.backend() == "onednn"
        assert amx_linear.tiles_problem() == f"{amx_linear.ONEDNN_ENV}=1"
        lin = AmxLinear.from_weight(torch.randn(48, 64))
        assert "oneDNN" in repr(lin) and lin(torch.randn(40, 64)).shape == (40, 48)
    finally:
        cpu_kernels.use_isa(None)
