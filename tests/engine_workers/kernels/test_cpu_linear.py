"""oneDNN linears with weights packed once (engine_workers/kernels/cpu_linear.py): same results as
``F.linear`` for any row count, used by the engine by default on CPU fp32, switchable off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels.cpu_linear import (
    PackedLinear,
    packing_problem,
    prepack_linears,
)
from tests.engine_workers.engine.test_engine_hf_parity import run_together, workload

# every test at each ISA level this host runs (tests/engine_workers/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

needs_onednn = pytest.mark.skipif(packing_problem(torch.device("cpu"), torch.float32) is not None,
                                  reason="this torch build has no usable oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 77, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    packed = PackedLinear.from_linear(lin)
    got = packed(x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, lin(x).detach(), rtol=1e-5, atol=1e-4)
    # the same packed weight serves every row count (decode batches vary step to step)
    torch.testing.assert_close(packed(x[:1]), lin(x[:1]).detach(), rtol=1e-5, atol=1e-4)


def test_packing_problem_names_why():
    assert "float32 on CPU" in packing_problem(torch.device("cpu"), torch.bfloat16)
    assert "float32 on CPU" in packing_problem(torch.device("cuda"), torch.float32)


@needs_onednn
def test_prepack_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    want = model(x).detach()
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_engine_packs_by_default_and_greedy_output_is_unchanged(tiny_model_dir):
    packed = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20))
    plain = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20, weight_prepack=False))
    layers = packed.runner.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, PackedLinear) and isinstance(layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(packed.runner.model.lm_head, PackedLinear)
    assert isinstance(plain.runner.model.layers[0].self_attn.qkv_proj, nn.Linear)
    reqs = workload(packed.loaded.spec.vocab_size, 8, seed=7, max_prompt=120, max_new=24)
    assert run_together(packed, reqs) == run_together(plain, reqs)


def test_flag_turns_packing_off():
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    args = build_parser().parse_args(["generate", "--no-weight-prepack", "hi"])
    assert engine_config_from_args(args).weight_prepack is False
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).weight_prepack is True



@needs_onednn
def test_tied_embeddings_get_a_packed_head_and_the_same_output(tmp_path):
    from devtools.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    packed = Engine(EngineConfig(model=path, dtype="float32", kv_cache_bytes=16 << 20))
    plain = Engine(EngineConfig(model=path, dtype="float32", kv_cache_bytes=16 << 20, weight_prepack=False))
    assert isinstance(packed.runner.model.lm_head, PackedLinear)
    assert plain.runner.model.lm_head is None  # tied: the head reads the embedding matrix
    reqs = workload(packed.loaded.spec.vocab_size, 6, seed=3, max_prompt=80, max_new=16)
    assert run_together(packed, reqs) == run_together(plain, reqs)


# --- the small-batch kernel (csrc/small_m_linear.cpp) behind PackedLinear ---------------------------

def _small_m():
    from engine_workers.kernels import cpu_kernels

    fns = cpu_kernels.small_m()
    if fns is None:
        pytest.skip(f"no small-batch linear kernel here: {cpu_kernels.small_m_problem()}")
    return fns


@needs_onednn
@pytest.mark.parametrize("n, k", [(96, 64), (200, 70), (1000, 130)])  # panel tail, k-block tail
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_kernel_matches_f_linear_for_every_row_count(n, k, bias):
    from engine_workers.kernels.cpu_linear import SMALL_M_MAX

    small_m = _small_m()
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    lin = PackedLinear.from_weight(w, b, small_m=small_m)
    assert lin.panels is not None and "small-batch kernel" in repr(lin)
    for rows in [*range(1, 10), 16, 31, SMALL_M_MAX, SMALL_M_MAX + 1, 100]:  # both sides of the switch
        x = torch.randn(rows, k, generator=gen)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # a non-contiguous input is made contiguous, not misread
    xt = torch.randn(k, 5, generator=gen).t()
    torch.testing.assert_close(lin(xt), torch.nn.functional.linear(xt, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(bias):
    """Issue #38: a row's output must be bit-identical alone and inside any batch, also above
    SMALL_M_MAX rows (a decode step that carries a prefill chunk, a resumed request's re-prefill).
    oneDNN sums in another order there (~1e-5 apart), which flipped a near-tie under sampling."""
    small_m = _small_m()
    gen = torch.Generator().manual_seed(38)
    w = torch.randn(1536, 576, generator=gen)  # SmolLM2's MLP shape: long enough sums to differ
    b = torch.randn(1536, generator=gen) if bias else None
    lin = PackedLinear.from_weight(w, b, small_m=small_m)
    x = torch.randn(130, 576, generator=gen)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (2, 31, 32, 33, 64, 100, 130):
        batched = lin(x[:rows])
        assert torch.equal(batched, alone[:rows]), f"{rows} rows: max diff {(batched - alone[:rows]).abs().max()}"


def test_small_batch_kernel_rejects_mismatched_inputs():
    pack, linear = _small_m()
    panels = pack(torch.randn(100, 64))
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(3, 65), panels, 100, None)
    with pytest.raises(RuntimeError, match="panels"):
        linear(torch.randn(3, 64), panels, 300, None)
    with pytest.raises(RuntimeError, match="bias"):
        linear(torch.randn(3, 64), panels, 100, torch.randn(7))


@needs_onednn
def test_engine_uses_the_small_batch_kernel_only_with_cpu_kernels_on(tiny_model_dir):
    _small_m()
    on = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20))
    off = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20, cpu_kernels=False))
    packed_on = [m for m in on.runner.model.modules() if isinstance(m, PackedLinear)]
    packed_off = [m for m in off.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed_on and all(m.panels is not None for m in packed_on)
    assert packed_off and all(m.panels is None for m in packed_off)
    reqs = workload(on.loaded.spec.vocab_size, 8, seed=11, max_prompt=100, max_new=20)
    assert run_together(on, reqs) == run_together(off, reqs)


@needs_onednn
def test_small_batch_kernel_stays_off_when_its_copies_would_not_fit(tiny_model_dir, monkeypatch, caplog):
    from engine_workers.kernels import cpu_linear

    _small_m()
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 1 << 20)  # 1 MiB "available"
    eng = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20))
    packed = [m for m in eng.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.panels is None for m in packed)
    assert "small-batch linear kernel off" in caplog.text and "available" in caplog.text


def test_panel_bytes_counts_padded_rows():
    from engine_workers.kernels.cpu_linear import panel_bytes

    assert panel_bytes([torch.empty(96, 10), torch.empty(97, 10)]) == (96 * 10 + 192 * 10) * 4


# --- batch invariance of every CPU weight mode (issue #38) -------------------------------------------

def _mode_linear(mode: str, w: torch.Tensor, b: torch.Tensor | None) -> nn.Module:
    """The layer ``mode`` runs a linear on (skips where this host cannot run it)."""
    from engine_workers.kernels.cpu_linear import LowpLinear, lowp_problem

    if mode == "onednn":  # --no-cpu-kernels (and hosts without the small-batch kernel)
        if packing_problem(torch.device("cpu"), torch.float32) is not None:
            pytest.skip("this torch build has no usable oneDNN linear")
        return PackedLinear.from_weight(w, b, small_m=None)
    if mode == "float32":
        return PackedLinear.from_weight(w, b, small_m=_small_m())
    kind = {"bf16": "bfloat16"}.get(mode, mode)
    why = lowp_problem(kind)
    if why is not None:
        pytest.skip(f"{mode} kernel: {why}")
    if mode == "bf16":  # the engine's bf16 layer: on AMX tiles at the amx ISA level, else LowpLinear
        from engine_workers.kernels.amx_linear import AmxLinear, amx
        from engine_workers.kernels.cpu_linear import bf16_layer

        lin = bf16_layer(w, b)
        assert isinstance(lin, AmxLinear) == amx()  # no silent fallback where AMX was meant
        return lin
    if mode == "int8":
        return LowpLinear.from_weight(kind, w, b)
    if mode == "w8a8":
        from engine_workers.kernels.w8a8_linear import W8A8Linear

        return W8A8Linear.from_weight(w, b)
    from engine_workers.kernels.cpu_blocks import BlockLinear

    return BlockLinear.quantized(mode, w, b)  # q4_1 (and q8_0, the q4_1 mode's head)


MODES = ["float32", "onednn", "bf16", "int8", "w8a8", "q4_1", "q8_0"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536), (200, 1056)])  # SmolLM2's up and down; K past 1024
def test_every_weight_mode_gives_a_row_the_same_result_alone_and_in_any_batch(mode, n, k):
    """A row's output bit for bit the same alone and in batches of 2..1100 rows, for every CPU
    weight mode. Before issue #38's fixes: q4_1 (rows 1-4 summed each block's k in another order
    than 5+), oneDNN alone (one row over more than 1024 features, and inputs of ~1100 rows, took
    other kernels)."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    lin = _mode_linear(mode, w, b)
    x = torch.randn(1100, k, generator=gen)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(130)])
    for rows in (2, 3, 4, 5, 6, 7, 31, 32, 33, 64, 100, 130):
        got = lin(x[:rows])
        assert torch.equal(got, alone[:rows]), f"{mode}, {rows} rows: max diff {(got - alone[:rows]).abs().max():.3g}"
    big = lin(x)  # a long prefill step: its first rows as when computed in small batches
    assert torch.equal(big[:130], alone), f"{mode}, 1100 rows: max diff {(big[:130] - alone).abs().max():.3g}"
    assert torch.equal(big[1000:1100], lin(x[1000:1100]))


ENGINE_MODES = {"float32": {"dtype": "float32"}, "no-cpu-kernels": {"dtype": "float32", "cpu_kernels": False}, "bf16": {"dtype": "bfloat16"},
                "int8": {"quantization": "int8"}, "w8a8": {"quantization": "w8a8"}, "q4_1": {"quantization": "q4_1"}}


@pytest.fixture(scope="module")
def wide_mlp_model(tmp_path_factory) -> str:
    """A tiny model whose down projection sums over 1536 features (SmolLM2's), past oneDNN's
    one-row threshold."""
    from devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("wide-mlp"), intermediate_size=1536))


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_every_weight_mode_gives_a_sequence_the_same_logits_alone_and_in_a_mixed_step(wide_mlp_model, mode):
    """Through the whole model: a prompt's next-token logits, and then one decode step's, bit for
    bit the same computed alone and inside steps with other sequences' prefills and decodes (the
    decode inside a step of more than 32 rows), for every CPU weight mode the engine offers. This
    is what keeps a resumed sampled stream equal to its healthy run after a worker death."""
    from engine_workers.kernels.cpu_linear import lowp_problem
    from engine_workers.model.execution.batch import Chunk, ModelInput

    kw = ENGINE_MODES[mode]
    kind = "bfloat16" if kw.get("dtype") == "bfloat16" else kw.get("quantization")
    if kind is not None and lowp_problem(kind) is not None:
        pytest.skip(f"{mode} kernel: {lowp_problem(kind)}")
    eng = Engine(EngineConfig(model=wide_mlp_model, device="cpu", kv_cache_bytes=16 << 20, **kw))
    assert eng.weight_format == {"no-cpu-kernels": "float32", "bf16": "bfloat16"}.get(mode, mode)
    if mode == "bf16":  # the amx level's bf16 runs on AMX tiles: that is the path checked there
        from engine_workers.kernels.amx_linear import AmxLinear, amx

        assert amx() == any(isinstance(m, AmxLinear) for m in eng.loaded.model.modules())
    bs = eng.kv.block_size

    def run(chunks: list[tuple[list[int], int, list[int], bool]]) -> torch.Tensor:
        return eng.runner.execute(ModelInput(tuple(Chunk(*c) for c in chunks))).logits

    gen = torch.Generator().manual_seed(38)
    a, b, c, d = (torch.randint(3, 500, (n,), generator=gen).tolist() for n in (40, 7, 60, 33))

    def blocks(first: int, tokens: int) -> list[int]:
        return list(range(first, first + -(-tokens // bs)))

    pa = run([(a, 0, blocks(0, 41), True)])[0]
    t = int(pa.argmax())
    da = run([([t], 40, blocks(0, 41), True)])[0]
    # the same sequence again in other blocks, batched: prefilled between two other prompts, then
    # its decode in a step that also prefills a fourth prompt and decodes the second
    ba, bb, bc, bd = blocks(10, 41), blocks(20, 9), blocks(30, 61), blocks(40, 34)
    pb = run([(b, 0, bb, True), (a, 0, ba, True), (c, 0, bc, True)])[1]
    db = run([(d, 0, bd, True), ([t], 40, ba, True), ([5], len(b), bb, True)])[1]
    assert torch.equal(pa, pb), f"{mode} prefill: max diff {(pa - pb).abs().max():.3g}"
    assert torch.equal(da, db), f"{mode} decode: max diff {(da - db).abs().max():.3g}"
