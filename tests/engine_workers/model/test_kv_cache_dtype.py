"""K/V cache in bf16 on CPU (``--kv-cache-dtype``; model/execution/runner.py, model/models/attention.py, the CPU
attention kernels reading bf16 through csrc/kv_elem.h): the kernels and the torch path against
torch references on a bf16 cache, the engine's logits and greedy tokens against a float32 cache
within stated bounds, twice the blocks for one byte budget, bad values refused.

The cache holds K/V rounded to bf16 and every reader widens them, so attention over a bf16 cache
equals float32 attention over the rounded K/V up to float32 reduction order (the kernel tolerances
below are float32's), except the prefill kernel's float16 pass on CPUs with AVX512-FP16 (Q . K
and P . V in float16 in short runs, ~1e-3 relative here: ``cpu_kernels.prefill_close``). Through
a model the rounding adds up layer by layer. Measured 2026-12-05 (bound in brackets): tiny model (random weights), 3 prompts, next-token
logits rel L2 0.0075 after a prefill and after a decode step, kernels or torch path (0.02), 16
greedy tokens agree 1.0 (0.7); SmolLM2-135M, the slow test's 4 chat prompts: rel L2 0.0013 (0.01),
first tokens all equal, 24 greedy tokens agree 1.0 (0.6; with 6 prompts and 32 tokens 0.0020 and
0.89: one prompt's continuation flips late)."""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import cpu_kernels
from engine_workers.kernels.paged_reference import sdpa_decode
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import kv_block_bytes
from engine_workers.model.models.attention import build_metadata, paged_attention
from lockgate_types import SamplingParams
from tests.engine_workers.kernels.test_lowp_weights import agreement, next_logits, rel_l2
from tests.engine_workers.model.test_attention import dense_reference

# every test at each ISA level this host runs (tests/engine_workers/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def decode_kernel():
    fn = cpu_kernels.paged_decode()
    if fn is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    return fn


def prefill_kernel():
    fn = cpu_kernels.prefill_attention()
    if fn is None:
        pytest.skip(f"no CPU prefill kernel here: {cpu_kernels.prefill_problem()}")
    return fn


# -- kernels ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq, hkv, d, bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4), (6, 2, 24, 5), (3, 3, 7, 1)])
def test_decode_kernel_on_a_bf16_cache_matches_float32_attention_over_the_rounded_cache(hq, hkv, d, bs):
    """Scattered block tables, ragged contexts (1, a block exactly, one past it, a partial last
    block), GQA and plain multi-head, head sizes off the 16-lane vector (7, 24): the kernel on the
    bf16 cache equals SDPA on the widened cache, and so does the torch path (gather + widen)."""
    fn = decode_kernel()
    gen = torch.Generator().manual_seed(hq * d + bs)
    blocks = 40
    kc = torch.randn(blocks * bs, hkv, d, generator=gen).to(BF16)
    vc = torch.randn(blocks * bs, hkv, d, generator=gen).to(BF16)
    ctx = torch.tensor([1, bs, bs + 1, 7 * bs - 3, 9 * bs])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:9] for _ in range(5)])
    q = torch.randn(5, hq, d, generator=gen)
    want = cpu_kernels.reference_decode(q, kc.float(), vc.float(), tables, ctx, bs, d**-0.5)
    torch.testing.assert_close(fn(q, kc, vc, tables, ctx, bs, d**-0.5), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.reference_decode(q, kc, vc, tables, ctx, bs, d**-0.5), want)


@pytest.mark.parametrize("n, ctx, hq, hkv, d", [(1, 1, 9, 3, 64), (4, 4, 6, 2, 8), (33, 33, 9, 3, 64),
                                                (1, 97, 4, 4, 32), (96, 300, 6, 2, 64), (7, 50, 6, 3, 24)])
def test_prefill_kernel_on_bf16_kv_matches_float32_attention_over_the_rounded_kv(n, ctx, hq, hkv, d):
    """Tile tails, continuations (ctx > n), GQA, a strided query view; K/V strided views of a
    fused bf16 row too (as a gathered cache is not, but a kernel must not assume it)."""
    fn = prefill_kernel()
    gen = torch.Generator().manual_seed(n * ctx + d)
    q = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)[:, : hq * d].view(n, hq, d)
    kv = torch.randn(ctx, 2 * hkv * d, generator=gen).to(BF16)
    k, v = kv[:, : hkv * d].view(ctx, hkv, d), kv[:, hkv * d :].view(ctx, hkv, d)
    want = cpu_kernels.reference_prefill(q, k.float(), v.float(), 0.3)
    got = fn(q, k, v, 0.3)
    if cpu_kernels.prefill_f16_values() and d % 16 == 0:
        assert cpu_kernels.prefill_close(got, want, BF16)
    else:  # head sizes off 16 always take the float32 pass
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_prefill_float16_pass_error_is_bounded_and_out_of_range_inputs_take_float32():
    """On a CPU with AVX512-FP16, a bf16 cache's Q . K and P . V run in float16: the error is
    float16-sized (nonzero, relative L2 under 3e-3) however many key blocks and whichever pair (odd
    ctx) a key falls in. Inputs a float16 sum could overflow on take the float32 pass, exact to
    float32's rounding: values with |v| > 1024, and a key too large for float16 beside a zero
    query (the product bound alone would pass it). Elsewhere every case is exact."""
    fn = prefill_kernel()
    gen = torch.Generator().manual_seed(3)
    n, ctx, hq, hkv, d = 200, 517, 9, 3, 64
    q = torch.randn(n, hq, d, generator=gen)
    k, v = torch.randn(ctx, hkv, d, generator=gen).to(BF16), torch.randn(ctx, hkv, d, generator=gen).to(BF16)
    want = cpu_kernels.reference_prefill(q, k.float(), v.float(), 0.125)
    got = fn(q, k, v, 0.125)
    rel = ((got - want).norm() / want.norm()).item()
    if cpu_kernels.prefill_f16_values():
        assert 1e-5 < rel < 3e-3, rel
    else:
        assert rel < 1e-5, rel
    big = (v.float() * 2000).to(BF16)  # 48 keys x |v| up to ~8000 would overflow float16 (65504)
    torch.testing.assert_close(fn(q, k, big, 0.125), cpu_kernels.reference_prefill(q, k.float(), big.float(), 0.125),
                               rtol=1e-4, atol=1e-3)
    # one key of 70000 (inf in float16) beside a zero query: scores 0 everywhere, so the output
    # is the plain mean of the values; in float16 it came out as 0 * inf poisoning that score
    q0, k1 = torch.zeros(1, 1, 16), torch.zeros(2, 1, 16, dtype=BF16)
    k1[0, 0, 0] = 70000
    v1 = torch.stack([torch.ones(1, 16), torch.full((1, 16), 3.0)]).to(BF16)
    torch.testing.assert_close(fn(q0, k1, v1, 0.25), torch.full((1, 1, 16), 2.0))


def test_kernels_refuse_mixed_or_unsupported_kv_dtypes():
    fn, pf = decode_kernel(), prefill_kernel()
    q, kc = torch.zeros(1, 2, 8), torch.zeros(16, 1, 8)
    tables, ctx = torch.tensor([[0]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="one dtype"):
        fn(q, kc, kc.to(BF16), tables, ctx, 4, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fn(q, kc.half(), kc.half(), tables, ctx, 4, 1.0)
    with pytest.raises(RuntimeError, match="q must be float32"):
        fn(q.to(BF16), kc.to(BF16), kc.to(BF16), tables, ctx, 4, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        pf(torch.zeros(3, 2, 8), torch.zeros(3, 1, 8).half(), torch.zeros(3, 1, 8).half(), 1.0)


@pytest.mark.parametrize("kernels", [False, True])
def test_mixed_batch_on_a_bf16_cache_matches_dense_attention_over_rounded_kv(kernels):
    """One step of decodes, a chunk starting its sequence and a chunk continuing one, blocks
    scattered: every row equals dense float32 causal attention over K/V rounded to bf16 (the chunk
    that starts its sequence too: it attends over its K/V as stored), and the new K/V land in the
    cache rounded."""
    fn, pf = (decode_kernel(), prefill_kernel()) if kernels else (None, None)
    bs, hq, hkv, d = 4, 6, 2, 8
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    num_blocks = 64
    k_cache, v_cache = torch.zeros(num_blocks * bs, hkv, d, dtype=BF16), torch.zeros(num_blocks * bs, hkv, d, dtype=BF16)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    plan = [(1, 0), (9, 8), (30, 29), (3, 2), (11, 0), (14, 5)]  # (length after the step, computed before)
    seqs, chunks, new, slots = [], [], [], []
    for total, before in plan:
        q = torch.randn(total, hq, d, generator=gen)
        k, v = torch.randn(total, hkv, d, generator=gen), torch.randn(total, hkv, d, generator=gen)
        blocks = [free.pop() for _ in range(-(-total // bs))]
        for p in range(total):
            slot = blocks[p // bs] * bs + p % bs
            if p < before:
                k_cache[slot], v_cache[slot] = k[p], v[p]
            else:
                slots.append(slot)
        seqs.append((q, k.to(BF16).float(), v.to(BF16).float()))
        chunks.append((before, total - before, blocks))
        new.append((q[before:], k[before:], v[before:]))
    meta, _ = build_metadata(chunks, bs, CPU, decode_kernel=fn, prefill_kernel=pf)
    qn, kn, vn = (torch.cat(x) for x in zip(*new))
    out = paged_attention(qn, kn, vn, k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == torch.float32 and k_cache.dtype == BF16
    want = torch.cat(dense_reference(seqs, [before for _, before in plan])).reshape(-1, hq * d)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(k_cache[slots], kn.to(BF16)) and torch.equal(v_cache[slots], vn.to(BF16))


def test_torch_decode_path_widens_a_bf16_cache():
    """The path without the kernel (``--no-cpu-kernels``, CUDA): gather, widen, SDPA in q's dtype."""
    gen = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(32, 2, 8, generator=gen).to(BF16), torch.randn(32, 2, 8, generator=gen).to(BF16)
    q, tables, ctx = torch.randn(2, 4, 8, generator=gen), torch.tensor([[3, 1], [6, 0]]), torch.tensor([7, 2])
    from engine_workers.kernels.paged_reference import decode_mask

    mask = decode_mask(ctx, 8, torch.float32)
    got = sdpa_decode(q, kc, vc, tables, mask, 4, 0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sdpa_decode(q, kc.float(), vc.float(), tables, mask, 4, 0.5))


# -- configuration --------------------------------------------------------------------------------------


def test_flag_env_twin_and_default():
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["generate", "hi"])).kv_cache_dtype == "auto"
    assert engine_config_from_args(parse(["generate", "--kv-cache-dtype", "bfloat16", "hi"])).kv_cache_dtype == "bfloat16"
    for cmd in (["worker"], ["serve"], ["bench", "engine"]):  # every engine-building command has it
        args = build_parser().parse_args([*cmd, "--kv-cache-dtype", "float32"])
        assert args.kv_cache_dtype == "float32", cmd


def test_env_twin(monkeypatch):
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    monkeypatch.setenv("LOCKGATE_KV_CACHE_DTYPE", "bfloat16")
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).kv_cache_dtype == "bfloat16"
    monkeypatch.setenv("LOCKGATE_KV_CACHE_DTYPE", "int4")  # argparse does not check defaults: the config does
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, got 'int4'"):
        engine_config_from_args(build_parser().parse_args(["generate", "hi"]))


def test_bad_values_refused(capsys, tiny_model_dir):
    from lockgate.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "hi"])
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    for bad in ("fp8", "bf16", "", "BFLOAT16"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)
    # float16 is for CUDA: on a CPU the engine refuses it, naming the alternative, before loading anything
    with pytest.raises(ValueError, match="float16 is for CUDA; on a CPU use bfloat16"):
        Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_dtype="float16"))


def test_resolution():
    from engine_workers.model.execution.runner import resolve_kv_dtype

    cuda = torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32, CPU) == BF16
    assert resolve_kv_dtype("float32", torch.bfloat16, cuda) == torch.float32
    assert resolve_kv_dtype("float16", torch.bfloat16, cuda) == torch.float16


# -- through the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir: str, isa: str) -> dict[str, Engine]:
    cfg = dict(model=tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=8, kv_cache_bytes=8 << 20)
    return {"float32": Engine(EngineConfig(**cfg)), "bfloat16": Engine(EngineConfig(**cfg, kv_cache_dtype="bfloat16")),
            "bfloat16-torch": Engine(EngineConfig(**cfg, kv_cache_dtype="bfloat16", cpu_kernels=False))}


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 60)), [300, 301, 302, 7, 9] * 5]


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens under a fresh prefix-cache salt: the logits helpers write blocks directly,
    behind the cache's back, so an unsalted run could hit blocks they overwrote."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _ in prompts]
    return [list(d.token_ids) for d in engine.generate(prompts, params, cache_salt=uuid.uuid4().hex)]


def decode_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits of each prompt with its last token as a decode step (the decode path)."""
    rows = []
    for ids in prompts:
        blocks = list(range(-(-len(ids) // engine.kv.block_size)))
        engine.runner.execute(ModelInput((Chunk(ids[:-1], 0, blocks, False),)))
        rows.append(engine.runner.execute(ModelInput((Chunk(ids[-1:], len(ids) - 1, blocks, True),))).logits[0].float())
    return torch.stack(rows)


def test_bf16_cache_is_bf16_with_twice_the_blocks(engines):
    ref, bf = engines["float32"], engines["bfloat16"]
    assert bf.kv_dtype == BF16 and all(k.dtype == v.dtype == BF16 for k, v in bf.runner.kv_caches)
    assert bf.dtype == torch.float32 and ref.kv_dtype == torch.float32  # compute stays float32
    spec, bs = ref.loaded.spec, ref.kv.block_size
    assert kv_block_bytes(spec, bs, BF16) * 2 == kv_block_bytes(spec, bs, torch.float32)
    assert bf.kv.num_blocks == (8 << 20) // kv_block_bytes(spec, bs, BF16)
    assert ref.kv.num_blocks == (8 << 20) // kv_block_bytes(spec, bs, torch.float32)
    assert bf.kv.num_blocks in (2 * ref.kv.num_blocks, 2 * ref.kv.num_blocks + 1)
    # the bytes actually allocated are the budget's, not twice it
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in bf.runner.kv_caches)
    assert allocated <= 8 << 20


@pytest.mark.parametrize("path", ["bfloat16", "bfloat16-torch"])
def test_logits_and_greedy_close_to_a_float32_cache(engines, path):
    ref, eng = engines["float32"], engines[path]
    if path == "bfloat16":
        assert eng.runner.decode_kernel is not None or cpu_kernels.paged_decode() is None
    else:
        assert eng.runner.decode_kernel is None and eng.runner.prefill_kernel is None
    for logits in (next_logits, decode_logits):
        err = rel_l2(logits(eng, PROMPTS), logits(ref, PROMPTS))
        assert 0 < err < 0.02, f"{logits.__name__}: rel L2 {err:.4f} vs a float32 cache"
    assert agreement(greedy(eng, PROMPTS, 16), greedy(ref, PROMPTS, 16)) >= 0.7


def test_kernel_and_torch_path_agree_on_a_bf16_cache(engines):
    """Both read the same rounded K/V and do float32 math: the same tokens on a mixed workload."""
    from tests.engine_workers.engine.test_engine_hf_parity import run_together, workload

    if engines["bfloat16"].runner.decode_kernel is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    reqs = workload(engines["float32"].loaded.spec.vocab_size, 8, seed=21, max_prompt=120, max_new=24)
    assert run_together(engines["bfloat16"], reqs) == run_together(engines["bfloat16-torch"], reqs)


def test_prefix_cache_hit_gives_the_same_tokens_on_a_bf16_cache(engines):
    """A prompt's first pass prefills it, the second reuses its cached blocks and recomputes only
    the tail: both attend over the K/V as stored, so the tokens are the same."""
    eng = engines["bfloat16"]
    prompt = [random.Random(3).randrange(3, 500) for _ in range(70)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    salt = uuid.uuid4().hex
    first = eng.generate([prompt], params, cache_salt=salt)[0]
    second = eng.generate([prompt], params, cache_salt=salt)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0, "the second pass did not hit the prefix cache"
    assert list(second.token_ids) == list(first.token_ids)


@pytest.mark.slow
def test_default_model_bf16_cache_close_to_float32(default_model_dir: str) -> None:
    """SmolLM2-135M, chat prompts: next-token logits and 24 greedy tokens, bf16 vs float32 cache."""
    ref = Engine(EngineConfig(model=default_model_dir, dtype="float32", device="cpu", kv_cache_bytes=64 << 20))
    eng = Engine(EngineConfig(model=default_model_dir, dtype="float32", device="cpu", kv_cache_bytes=64 << 20,
                              kv_cache_dtype="bfloat16"))
    chats = ["What is the capital of France?", "Write a haiku about rain.", "Explain what a hash table is.",
             "Translate 'good morning' into German."]
    prompts = [ref.encode_prompt(messages=[{"role": "user", "content": c}]) for c in chats]
    got, want = next_logits(eng, prompts), next_logits(ref, prompts)
    err = rel_l2(got, want)
    assert err < 0.01, f"next-token logits rel L2 {err:.4f} vs a float32 cache"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert agreement(greedy(eng, prompts, 24), greedy(ref, prompts, 24)) >= 0.6
