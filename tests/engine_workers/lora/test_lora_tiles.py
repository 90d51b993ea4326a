"""Adapters in bf16 on the AMX tile kernel beside a bf16 base (engine_workers/model/lora/tiles.py,
the stacked form of layers.py): the update equals its definition on the bf16-rounded operands,
with ranks that need padding, empty slots, interleaved base rows and a slot changed between steps;
every row's output is bit for bit the row alone, whatever other slots share the step (batch
invariance); through the engine, the adapter's effect on the logits matches float32's within the
bf16 base's own error, and a batch mixing two adapters and the base model gives each request
exactly the logits and tokens it gets alone."""

from __future__ import annotations

import random

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import amx_linear, cpu_kernels
from engine_workers.kernels import isa as isa_levels
from engine_workers.kernels.amx_linear import AmxLinear
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.lora.adapter import LoraWeights
from engine_workers.model.lora.layers import LoraBatch, LoraLinear
from lockgate_types import SamplingParams
from tests.engine_workers.lora.adapters import make_adapter

pytestmark = pytest.mark.skipif(isa_levels.host_isa() != "amx", reason="needs a CPU with AMX tiles (amx_bf16)")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def amx_level():
    try:
        assert cpu_kernels.use_isa("amx") == "amx"
        if amx_linear.tiles() is None:
            pytest.skip(f"AMX tile kernel unavailable: {amx_linear.tiles_problem()}")
        yield
    finally:
        cpu_kernels.use_isa(None)


def definition(x: torch.Tensor, w: LoraWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The update on the bf16-rounded operands in float64 (``h`` rounded to bf16 between the two
    products, as the kernel does), and a bound on the float32 summation and that rounding's error."""
    h = x.bfloat16().double() @ w.a.bfloat16().double().T
    b = w.b.bfloat16().double()
    return h.float().bfloat16().double() @ b.T, (h.abs() @ b.abs().T) * 2 ** -7 + 1e-6


def test_stacked_update_is_its_definition_and_each_row_alone(amx_level):
    g = torch.Generator().manual_seed(0)
    fan_in, fan_out = 96, 80  # neither a multiple of 32: the kernel's padding of K and of the columns
    base = AmxLinear.from_weight(torch.randn(fan_out, fan_in, generator=g) * 0.1)
    batch = LoraBatch()
    lin = LoraLinear(base, batch, max_loras=5, tile_ops=amx_linear.tiles())
    assert lin.tiles is not None

    def weights(rank: int) -> LoraWeights:
        return LoraWeights(torch.randn(rank, fan_in, generator=g) * 0.2, torch.randn(fan_out, rank, generator=g) * 0.2)

    slots: list[LoraWeights | None] = [weights(4), None, weights(16), weights(20), None]  # widths 16, -, 16, 32
    for s, w in enumerate(slots):
        lin.set_slot(s, w)
    rows: list[int | None] = [None, 0, 2, None, 3, 0, 2, 2, None]  # interleaved, base rows inside the span
    x = torch.randn(len(rows), fan_in, generator=g)
    cpu = torch.device("cpu")
    with torch.no_grad():
        plain = base(x)
        batch.set(rows, cpu)
        got = lin(x)
        for i, s in enumerate(rows):
            w = slots[s] if s is not None else None
            if w is None:
                assert torch.equal(got[i], plain[i])  # a base row: the base layer's output, exactly
                continue
            want, bound = definition(x[i:i + 1], w)
            assert ((got[i].double() - plain[i].double() - want[0]).abs() <= bound[0]).all(), i
        for i, s in enumerate(rows):  # each row alone: bit for bit
            batch.set([s], cpu)
            assert torch.equal(lin(x[i:i + 1])[0], got[i]), i
        # other neighbours: slot 1 filled (it stacks between 0 and 2), slot 3 absent from the step
        lin.set_slot(1, weights(8))
        mixed: list[int | None] = [2, 1, 0, 1, 2]
        pick = [2, 1, 1, 1, 6]  # rows of x: slot 2's, then x[1] under slot 1, ..., slot 2's again
        batch.set(mixed, cpu)
        out = lin(x[pick])
        assert torch.equal(out[0], got[2]) and torch.equal(out[4], got[6]) and torch.equal(out[2], got[1])
        # a slot changed between steps: the stacked weights follow
        slots[2] = weights(12)
        lin.set_slot(2, slots[2])
        batch.set(rows, cpu)
        again = lin(x)
        want, bound = definition(x[2:3], slots[2])
        assert ((again[2].double() - plain[2].double() - want[0]).abs() <= bound[0]).all()
        assert torch.equal(again[4], got[4])  # slot 3 untouched
        batch.clear()
        assert torch.equal(lin(x), plain)  # no adapted row: the base layer alone


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiles")
    return {"a": make_adapter(tiny_model_dir, root / "a", ALL, r=16, alpha=16.0, seed=1),
            "b": make_adapter(tiny_model_dir, root / "b", ["q_proj", "v_proj", "down_proj"], r=6, seed=2)}


def make_engine(tiny_model_dir, adapters, dtype: str) -> Engine:
    return Engine(EngineConfig(model=tiny_model_dir, dtype=dtype, kv_cache_bytes=8 << 20, enable_lora=True,
                               max_num_batched_tokens=256, max_loras=2,
                               lora_modules=tuple((n, str(p)) for n, p in adapters.items())))


def logits(engine: Engine, prompts: list[list[int]], loras: list[str | None]) -> list[torch.Tensor]:
    chunks, first = [], 0
    for ids in prompts:
        n = -(-len(ids) // engine.config.block_size)
        chunks.append(Chunk(ids, 0, list(range(first, first + n)), True))
        first += n
    out = engine.runner.execute(ModelInput(tuple(chunks), every_row=True, loras=tuple(loras))).logits
    return list(out.split([len(p) for p in prompts]))


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def test_engine_adapter_effect_and_batch_invariance(amx_level, tiny_model_dir, adapters):
    tiles_engine = make_engine(tiny_model_dir, adapters, "auto")  # bf16 linears on the tiles here
    assert tiles_engine.lora is not None
    assert all(lin.tiles is not None for lin in tiles_engine.lora.layers.values())
    f32 = make_engine(tiny_model_dir, adapters, "float32")
    assert f32.lora is not None and all(lin.tiles is None for lin in f32.lora.layers.values())
    ps = prompts(5)
    with torch.no_grad():
        for name in adapters:  # the adapter's effect matches float32's within the bf16 base's own error
            base16, lora16 = logits(tiles_engine, ps[:1], [None])[0], logits(tiles_engine, ps[:1], [name])[0]
            base32, lora32 = logits(f32, ps[:1], [None])[0], logits(f32, ps[:1], [name])[0]
            effect32 = lora32 - base32
            assert effect32.abs().max() > 0.5  # the adapter changes the logits a lot
            quant_error = (base16 - base32).abs().max().item()
            assert 0 < quant_error
            assert ((lora16 - base16) - effect32).abs().max().item() < 2 * quant_error + 1e-3, name
        # a batch of the base model and both adapters, one adapter's rows not contiguous: every
        # request's logits bit for bit those it gets alone
        loras: list[str | None] = ["a", None, "b", "a", None]
        together = logits(tiles_engine, ps, loras)
        for i, (p, lo) in enumerate(zip(ps, loras, strict=True)):
            assert torch.equal(together[i], logits(tiles_engine, [p], [lo])[0]), i
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = [list(d.token_ids) for d in tiles_engine.generate(ps, params, loras=loras, cache_salt="mixed")]
    alone = [list(tiles_engine.generate([p], params, loras=[lo], cache_salt=f"alone-{i}")[0].token_ids)
             for i, (p, lo) in enumerate(zip(ps, loras, strict=True))]
    assert out == alone
