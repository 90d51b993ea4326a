"""4-bit block weights on CPU (``--quantization q4_1``; engine_workers/kernels/{block_quant,cpu_blocks}.py,
csrc/block_linear.cpp, engine_workers/model/loading/gguf_blocks.py): ggml's formats and quantizers against a
plain-Python reference, the kernel and the prefill path against ``F.linear`` of the dequantized
weight, bad inputs refused, the engine against float32, and (slow) the default model's GGUF blocks
against its float32 folder bit for bit.

Bounds: kernel vs ``F.linear`` of the same dequantized weight differs only by float32 summation
order (rtol 1e-4). Through a model: SmolLM2 from its GGUF computes with exactly the float32 weights,
so its logits differ by summation order only (measured 2026-12-05: rel L2 1.8e-6, bound 1e-4;
greedy agreement 1.0 over 6 chat prompts x 64 tokens, bound 0.99). The tiny random model, quantized
at load, is compared with the float32 model whose weights are those blocks dequantized (summation
order only: rel L2 bound 1e-4) and, loosely, with the original float32 model: 4-bit rounding of its
large random weights moves the logits a lot (measured rel L2 0.40, bound 0.6) and flips its
near-tied top tokens, so no token agreement is asked there."""

from __future__ import annotations

import logging
import math
import struct

import pytest
import torch
import torch.nn.functional as F

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels.block_quant import BlockWeight, quantize
from engine_workers.kernels.cpu_blocks import REGISTER_ROWS, BlockLinear, block_ops
from engine_workers.kernels.cpu_linear import cpu_weight_plan, lowp_problem

# every test at each ISA level this host runs (tests/engine_workers/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

CPU = torch.device("cpu")
needs_q4 = pytest.mark.skipif(lowp_problem("q4_1") is not None, reason=f"q4_1 kernel: {lowp_problem('q4_1')}")

# (M, N, K): the kernel's in-register loop (1..4 rows) and its buffered loop (more), with row-tile
# tails (M not a multiple of 6), panel tails (N not of 64), 128-k group tails (K not of 128), a
# prefill chunk on SmolLM2's down_proj shape
SHAPES = [(1, 64, 32), (2, 1, 64), (REGISTER_ROWS, 97, 160), (REGISTER_ROWS + 1, 200, 576), (16, 130, 96),
          (77, 191, 1536), (512, 576, 1536)]


def ggml_q4_1(row: list[float]) -> list[tuple[float, float, list[int]]]:
    """ggml's quantize_row_q4_1_ref, written out per element: ``(d, m, codes)`` per block."""
    out = []
    for b in range(0, len(row), 32):
        x = [float(torch.tensor(v, dtype=torch.float32)) for v in row[b : b + 32]]
        lo, hi = min(x), max(x)
        d = float(torch.tensor((hi - lo) / 15, dtype=torch.float32))
        inv = 1.0 / d if d else 0.0
        out.append((d, lo, [min(15, int((v - lo) * inv + 0.5)) for v in x]))
    return out


def test_q4_1_quantizer_matches_ggml_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 96, generator=gen) * torch.tensor([0.02, 1.0, 30.0]).unsqueeze(1)
    w[1, :32] = 0.5  # a constant block: d = 0, every code 0, w = m
    blocks = quantize("q4_1", w)
    for r in range(3):
        for b, (d, m, codes) in enumerate(ggml_q4_1(w[r].tolist())):
            assert float(blocks.scales[r, b]) == float(torch.tensor(d).half())
            assert float(blocks.mins[r, b]) == float(torch.tensor(m).half())
            raw = blocks.codes[r, 16 * b : 16 * b + 16].tolist()
            assert [c & 15 for c in raw] + [c >> 4 for c in raw] == codes
    deq = blocks.dequantize()
    assert torch.equal(deq[1, :32], torch.full((32,), 0.5))
    step = blocks.scales.float().repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= step * 0.5 + w.abs() * 2e-3 + 1e-6).all()  # half a step, plus fp16 d/m rounding


def test_q8_0_quantizer_rounds_half_away_from_zero() -> None:
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 127.0, 2.5, -2.5  # d = 1: 2.5 -> 3, -2.5 -> -3 (roundf, not banker's)
    blocks = quantize("q8_0", w)
    assert blocks.codes[0, :3].tolist() == [127, 3, -3] and float(blocks.scales[0, 0]) == 1.0
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(5, 64, generator=gen)
    blocks = quantize("q8_0", w)
    step = blocks.scales.float().repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - w).abs() <= step * 0.5 + w.abs() * 2e-3).all()


def test_gguf_block_bytes_decode_as_ggml_defines() -> None:
    # one Q4_1 block: d = 0.5, m = -1, byte j = (j % 16) | (15 - j % 16) << 4
    codes = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))
    raw = torch.tensor(list(struct.pack("<ee", 0.5, -1.0) + codes), dtype=torch.uint8).view(1, 20)
    w = BlockWeight.from_gguf_bytes("q4_1", raw).dequantize()
    want = [0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)]
    assert w.tolist() == [want]
    raw = torch.tensor(list(struct.pack("<e", 0.25) + bytes(range(0, 32)) ), dtype=torch.uint8).view(1, 34)
    raw[0, 2] = 0xFF  # int8 -1
    w = BlockWeight.from_gguf_bytes("q8_0", raw).dequantize()
    assert w.tolist() == [[-0.25] + [0.25 * j for j in range(1, 32)]]


@needs_q4
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch(m: int, n: int, k: int, kind: str, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    blocks = quantize(kind, w)
    lin = BlockLinear.from_blocks(blocks, b)
    assert torch.equal(lin.dequantized(), blocks.dequantize())  # packing keeps every code and scale
    got = lin(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # summation order only: |y| ~ sqrt(K) here, float32 sums of 1536 terms differ by ~1e-4
    torch.testing.assert_close(got, F.linear(x, blocks.dequantize(), b), rtol=1e-4, atol=1e-3)


@needs_q4
def test_leading_dims_and_other_dtypes() -> None:
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    lin = BlockLinear.quantized("q4_1", w)
    want = F.linear(x, lin.dequantized())
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lin(x.bfloat16()), F.linear(x.bfloat16().float(), lin.dequantized()), rtol=1e-4, atol=1e-4)


def test_bad_blocks_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize("q4_1", torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize("q4_1", torch.randn(64))
    with pytest.raises(ValueError, match="floating-point"):
        quantize("q8_0", torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize("q4_1", torch.tensor([[math.inf] + [0.0] * 31]))
    with pytest.raises(ValueError, match="float16 scales"):
        quantize("q8_0", torch.full((1, 32), 1e7))
    with pytest.raises(ValueError, match="block format"):
        quantize("q4_0", torch.randn(1, 32))
    good = quantize("q4_1", torch.randn(2, 64))
    with pytest.raises(ValueError, match="codes must be"):
        BlockWeight("q4_1", good.codes.to(torch.int8), good.scales, good.mins)
    with pytest.raises(ValueError, match="scales must be float16"):
        BlockWeight("q4_1", good.codes, good.scales.float(), good.mins)
    with pytest.raises(ValueError, match="need mins"):
        BlockWeight("q4_1", good.codes, good.scales)
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight.from_gguf_bytes("q4_1", torch.zeros(2, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot concatenate"):
        BlockWeight.cat([good, quantize("q8_0", torch.randn(2, 64))])


@needs_q4
def test_kernel_refuses_mismatched_inputs() -> None:
    lin = BlockLinear.quantized("q4_1", torch.randn(70, 64))
    ops = block_ops()
    assert ops is not None
    with pytest.raises(ValueError, match="96 features, the layer 64"):
        lin(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.randn(2, 96), lin.packed, 0, 70, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(torch.randn(2, 64, dtype=torch.float64), lin.packed, 0, 70, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.linear(torch.randn(2, 64), lin.packed, 0, 200, None)
    with pytest.raises(RuntimeError, match="pack_blocks"):
        ops.linear(torch.randn(2, 64), lin.packed, 1, 70, None)  # Q4_1 records read as Q8_0
    with pytest.raises(RuntimeError, match="kind"):
        ops.linear(torch.randn(2, 64), lin.packed, 7, 70, None)
    with pytest.raises(ValueError, match="bias"):
        BlockLinear.quantized("q4_1", torch.randn(70, 64), torch.randn(3))


def test_q4_1_plan_and_refusals() -> None:
    assert EngineConfig(quantization="q4_1").quantization == "q4_1"
    with pytest.raises(ValueError, match="none, int8, q4_1 or w8a8"):
        EngineConfig(quantization="q4_0")
    with pytest.raises(ValueError, match="CPU only"):
        cpu_weight_plan(torch.float32, "q4_1", torch.device("cuda"))
    with pytest.raises(ValueError, match="float32"):
        cpu_weight_plan(torch.bfloat16, "q4_1", CPU)
    want = (torch.float32, "q4_1") if lowp_problem("q4_1") is None else (torch.float32, None)
    assert cpu_weight_plan(torch.float32, "q4_1", CPU) == want


def test_q4_1_flag_through_the_shared_engine_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from lockgate.options import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--quantization", "q4_1"])).quantization == "q4_1"
    monkeypatch.setenv("LOCKGATE_QUANTIZATION", "q4_1")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).quantization == "q4_1"


def test_no_cpu_kernels_falls_back_to_float32(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert cpu_weight_plan(torch.float32, "q4_1", CPU, cpu_kernels=False) == (torch.float32, None)
    assert "q4_1 weights" in caplog.text and "--no-cpu-kernels" in caplog.text


# -- through the model -------------------------------------------------------------------------------


def _helpers():
    from tests.engine_workers.kernels.test_lowp_weights import agreement, greedy, next_logits, rel_l2

    return agreement, greedy, next_logits, rel_l2


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 60)), [300, 301, 302, 7, 9] * 5]


def _kind(name: str) -> str | None:
    """The block format ``--quantization q4_1`` gives an HF parameter (None: stays float32)."""
    if name == "lm_head.weight":
        return "q8_0"
    return "q4_1" if name.endswith(tuple(f"{x}.weight" for x in LINEARS)) else None


@pytest.fixture(scope="module")
def tiny_gguf_dirs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``dequantized``: the tiny model with every linear weight replaced by its blocks dequantized,
    and a GGUF of those blocks (llama.cpp's names, q/k rows in llama.cpp's RoPE order) named by
    its conversion marker, as tokenization/model_store.py writes it; ``mismatched``: the original
    float32 folder with a marker naming the same GGUF."""
    import json
    import shutil
    from pathlib import Path

    import gguf
    from safetensors.torch import load_file, save_file

    from engine_workers.model.models.llama import interleave_rope_rows

    root = tmp_path_factory.mktemp("tiny-gguf")
    src = Path(tiny_model_dir)
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(root / "tiny.gguf"), "llama")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    deq = dict(state)
    for name, w in state.items():
        kind = _kind(name)
        if kind is None:
            continue
        deq[name] = quantize(kind, w).dequantize()
        rows = w
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's converter permutes these rows
            rows = interleave_rope_rows(w, heads if "q_proj" in name else kv_heads, head_dim)
        b = quantize(kind, rows)
        parts = [b.scales.view(torch.uint8).view(-1, b.scales.shape[1], 2)]
        if b.mins is not None:
            parts.append(b.mins.view(torch.uint8).view(-1, b.scales.shape[1], 2))
        parts.append(b.codes.view(torch.uint8).view(b.codes.shape[0], b.scales.shape[1], -1))
        raw = torch.cat(parts, dim=2).reshape(b.codes.shape[0], -1).numpy()
        if name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        qtype = gguf.GGMLQuantizationType.Q4_1 if kind == "q4_1" else gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(gname, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    marker = json.dumps({"source": str(root / "tiny.gguf")})
    out = {}
    for label, weights in (("dequantized", deq), ("mismatched", state)):
        folder = root / label
        shutil.copytree(src, folder)
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "lockgate-converted.json").write_text(marker)
        out[label] = str(folder)
    return out


@pytest.fixture(scope="module")
def tiny_engines(tiny_model_dir: str, tiny_gguf_dirs: dict[str, str], isa: str) -> dict[str, Engine]:
    def engine(model: str, quantization: str = "none") -> Engine:
        return Engine(EngineConfig(model=model, device="cpu", dtype="float32", quantization=quantization, max_num_seqs=8,
                                   kv_cache_bytes=16 << 20, enable_prefix_caching=False))

    # no prefix caching: next_logits writes KV blocks behind the cache's back
    return {"float32": engine(tiny_model_dir), "q4_1": engine(tiny_model_dir, "q4_1"),
            "dequantized float32": engine(tiny_gguf_dirs["dequantized"])}


@needs_q4
def test_tiny_model_quantized_at_load_computes_with_its_blocks(tiny_engines: dict[str, Engine]) -> None:
    agreement, greedy, next_logits, rel_l2 = _helpers()
    eng, ref, deq = tiny_engines["q4_1"], tiny_engines["float32"], tiny_engines["dequantized float32"]
    assert eng.weight_format == "q4_1" and eng.dtype == torch.float32
    model = eng.loaded.model
    assert model.lm_head.kind == "q8_0" and model.layers[0].mlp.down_proj.kind == "q4_1"
    got = next_logits(eng, TINY_PROMPTS)
    # the float32 model with the dequantized blocks as weights: equal up to summation order
    assert rel_l2(got, next_logits(deq, TINY_PROMPTS)) < 1e-4
    assert agreement(greedy(eng, TINY_PROMPTS, 16), greedy(deq, TINY_PROMPTS, 16)) >= 0.9
    # the original float32 model: a real 4-bit rounding of random weights (no token agreement asked)
    assert rel_l2(got, next_logits(ref, TINY_PROMPTS)) < 0.6


@needs_q4
def test_blocks_read_from_the_gguf_the_folder_came_from(tiny_gguf_dirs: dict[str, str],
                                                        tiny_engines: dict[str, Engine],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    _, greedy, next_logits, _ = _helpers()
    with caplog.at_level(logging.INFO, logger="engine_workers.model.loading.loader"):
        eng = Engine(EngineConfig(model=tiny_gguf_dirs["dequantized"], device="cpu", quantization="q4_1",
                                  max_num_seqs=8, kv_cache_bytes=16 << 20, enable_prefix_caching=False))
    assert "9 from the GGUF's blocks" in caplog.text and "0 quantized at load" in caplog.text
    # the GGUF holds the blocks quantizing the original weights gives: the same numbers exactly
    assert torch.equal(next_logits(eng, TINY_PROMPTS), next_logits(tiny_engines["q4_1"], TINY_PROMPTS))
    assert greedy(eng, TINY_PROMPTS, 8) == greedy(tiny_engines["q4_1"], TINY_PROMPTS, 8)


@needs_q4
def test_gguf_that_is_not_the_folder_is_not_used(tiny_gguf_dirs: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine_workers.model.loading.loader"):
        Engine(EngineConfig(model=tiny_gguf_dirs["mismatched"], device="cpu", quantization="q4_1", max_num_seqs=8,
                            kv_cache_bytes=16 << 20))
    assert "do not dequantize to" in caplog.text and "9 quantized at load" in caplog.text


# -- the default model (slow) ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_gguf_blocks_are_its_float32_weights_bit_for_bit(default_model_dir: str) -> None:
    """The row mapping of engine_workers/model/loading/gguf_blocks.py, proven: every Q4_1/Q8_0 tensor of the
    GGUF, fused and ordered as lockgate fuses the HF folder's weights (q/k rows in lockgate's RoPE
    order), dequantizes to exactly the float32 weights the loader builds from the folder."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine_workers.model.loading.gguf_blocks import gguf_source, layer_blocks
    from engine_workers.model.loading.loader import _map_state
    from engine_workers.model.models.llama import ModelSpec

    folder = Path(default_model_dir)
    source = gguf_source(folder)
    assert source is not None, "the default model folder names its GGUF"
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(folder))
    state = _map_state(load_file(str(folder / "model.safetensors")), spec, folder)
    blocks = layer_blocks(source, spec)
    assert len(blocks) == 4 * spec.num_layers + 1
    assert blocks["lm_head"].kind == "q8_0" and blocks["layers.0.mlp.down_proj"].kind == "q4_1"
    for name, b in blocks.items():
        want = state["embed_tokens.weight" if name == "lm_head" else name + ".weight"]
        assert torch.equal(b.dequantize(), want), name


@pytest.mark.slow
@needs_q4
def test_default_model_q4_1_from_gguf_matches_float32(default_model_dir: str) -> None:
    """SmolLM2-135M, chat prompts: the 4-bit engine computes with the float32 model's exact
    weights, so logits differ by summation order and greedy tokens agree (>= 99 %)."""
    agreement, greedy, next_logits, rel_l2 = _helpers()
    ref = Engine(EngineConfig(model=default_model_dir, dtype="float32", device="cpu", kv_cache_bytes=64 << 20,
                              enable_prefix_caching=False))
    eng = Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache_bytes=64 << 20, quantization="q4_1",
                              enable_prefix_caching=False))
    assert eng.weight_format == "q4_1"
    chats = ["What is the capital of France?", "Write a haiku about rain.", "Explain what a hash table is.",
             "List three prime numbers.", "How do I boil an egg?", "Translate 'good morning' into German."]
    prompts = [ref.encode_prompt(messages=[{"role": "user", "content": c}]) for c in chats]
    assert rel_l2(next_logits(eng, prompts), next_logits(ref, prompts)) < 1e-4
    assert agreement(greedy(eng, prompts, 32), greedy(ref, prompts, 32)) >= 0.99
