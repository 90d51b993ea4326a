"""Paged attention (engine_workers/model/models/attention.py, cpu_kernels.py) and interleaved RoPE (llama.py):
each path against a plain dense reference, so a layout or masking mistake cannot hide behind the
end-to-end parity tests' tolerance for near-ties."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine_workers.kernels import cpu_kernels
from engine_workers.kernels import isa as isa_levels
from engine_workers.model.models.attention import (
    build_metadata,
    paged_attention,
    split_by_length,
)
from engine_workers.model.models.llama import apply_rope, interleave_rope_rows

BS, HQ, HKV, D = 4, 6, 2, 8


def dense_reference(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], start: list[int]) -> list[torch.Tensor]:
    """Per sequence: full q/k/v ``[L, H, D]``; returns the attention output of its last
    ``L - start`` positions, causal, GQA by repeating K/V."""
    outs = []
    for (q, k, v), s in zip(seqs, start):
        g = q.shape[1] // k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0), v.transpose(0, 1).repeat_interleave(g, 0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=D**-0.5).transpose(0, 1)
        outs.append(o[s:])
    return outs


@pytest.mark.parametrize("kernel, groups", [(False, 4), (False, 1), (True, 4)])
def test_mixed_batch_matches_dense_attention(kernel, groups):
    """One step of decodes (short and long contexts), a chunk starting its sequence and a chunk
    continuing one, blocks scattered in the cache: each row equals dense causal attention, through
    SDPA in length groups (CPU), SDPA in one padded group (CUDA's policy) and the CPU kernels."""
    fn = cpu_kernels.paged_decode() if kernel else None
    pf = cpu_kernels.prefill_attention() if kernel else None
    if kernel and (fn is None or pf is None):
        pytest.skip(f"no CPU kernels here: {cpu_kernels.problem() or cpu_kernels.prefill_problem()}")
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks * BS, HKV, D)
    v_cache = torch.zeros(num_blocks * BS, HKV, D)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    # (total length after this step, tokens computed before it)
    plan = [(1, 0), (9, 8), (30, 29), (3, 2), (11, 0), (14, 5)]
    seqs, chunks, new_q, new_k, new_v = [], [], [], [], []
    for total, before in plan:
        q = torch.randn(total, HQ, D, generator=gen)
        k = torch.randn(total, HKV, D, generator=gen)
        v = torch.randn(total, HKV, D, generator=gen)
        blocks = [free.pop() for _ in range(-(-total // BS))]
        for p in range(before):  # what earlier steps wrote
            slot = blocks[p // BS] * BS + p % BS
            k_cache[slot], v_cache[slot] = k[p], v[p]
        seqs.append((q, k, v))
        chunks.append((before, total - before, blocks))
        new_q.append(q[before:])
        new_k.append(k[before:])
        new_v.append(v[before:])
    meta, positions = build_metadata(chunks, BS, torch.device("cpu"), decode_kernel=fn, prefill_kernel=pf,
                                     max_decode_groups=groups)
    assert all(c.mask is None for c in meta.prefill) == kernel  # the kernel needs no masks
    if kernel or groups == 1:
        assert len(meta.decode) == 1  # every decode row in one call
    assert positions.tolist() == [p for total, before in plan for p in range(before, total)]
    out = paged_attention(torch.cat(new_q), torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, D**-0.5)
    want = torch.cat(dense_reference(seqs, [before for _, before in plan])).reshape(-1, HQ * D)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n, ctx, hq, hkv, d", [(1, 1, 9, 3, 64), (4, 4, 6, 2, 8), (33, 33, 9, 3, 64),
                                                (200, 200, 9, 3, 64), (1, 97, 4, 4, 32), (96, 300, 6, 2, 64),
                                                (70, 130, 8, 1, 128), (17, 17, 6, 2, 80), (40, 1000, 9, 3, 64)])
def test_prefill_kernel_matches_sdpa(n, ctx, hq, hkv, d):
    """Tile tails (rows not a multiple of the 8-row tile, keys not of the 48-key block, partial
    query blocks), continuations (ctx > n), GQA (up to 8 query heads per KV head) and plain
    multi-head, head sizes past one 64-wide value tile, a strided query view like the engine's
    fused QKV."""
    fn = cpu_kernels.prefill_attention()
    if fn is None:
        pytest.skip(f"no CPU prefill kernel here: {cpu_kernels.prefill_problem()}")
    gen = torch.Generator().manual_seed(n * ctx)
    fused = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    q = fused[:, : hq * d].view(n, hq, d)
    k, v = torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)
    torch.testing.assert_close(fn(q, k, v, 0.3), cpu_kernels.reference_prefill(q, k, v, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_kernel_matches_sdpa_at_other_thread_counts(threads):
    """The kernel sizes its query blocks from the thread count: other counts put the block edges
    elsewhere (and 3 threads on 2 cores oversubscribes the pool)."""
    fn = cpu_kernels.prefill_attention()
    if fn is None:
        pytest.skip(f"no CPU prefill kernel here: {cpu_kernels.prefill_problem()}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for n, ctx in ((5, 5), (61, 61), (130, 400)):
            q = torch.randn(n, 9, 64, generator=gen)
            k, v = torch.randn(ctx, 3, 64, generator=gen), torch.randn(ctx, 3, 64, generator=gen)
            torch.testing.assert_close(fn(q, k, v, 0.3), cpu_kernels.reference_prefill(q, k, v, 0.3),
                                       rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_prefill_kernel_online_softmax_rescales():
    """Scores whose maximum keeps rising with the key position (so each key block raises a row's
    running max and rescales what it summed before) and spans far more than float32's exp range
    within a row: the kernel must still match SDPA."""
    fn = cpu_kernels.prefill_attention()
    if fn is None:
        pytest.skip(f"no CPU prefill kernel here: {cpu_kernels.prefill_problem()}")
    gen = torch.Generator().manual_seed(5)
    n, hq, hkv, d = 300, 9, 3, 64
    q = torch.randn(n, hq, d, generator=gen).abs()
    ramp = torch.linspace(0.0, 8.0, n).view(n, 1, 1)  # later keys score higher against positive q
    k = torch.randn(n, hkv, d, generator=gen).abs() * ramp
    v = torch.randn(n, hkv, d, generator=gen)
    torch.testing.assert_close(fn(q, k, v, 0.5), cpu_kernels.reference_prefill(q, k, v, 0.5), rtol=1e-4, atol=1e-5)


def test_prefill_kernel_rejects_bad_shapes():
    fn = cpu_kernels.prefill_attention()
    if fn is None:
        pytest.skip(f"no CPU prefill kernel here: {cpu_kernels.prefill_problem()}")
    q, k = torch.randn(5, 6, 8), torch.randn(5, 2, 8)
    with pytest.raises(RuntimeError, match="n <= ctx"):
        fn(q, k[:3], k[:3], 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        fn(torch.randn(5, 5, 8), k, k, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        fn(q.double(), k.double(), k.double(), 1.0)


def test_split_by_length_groups_similar_lengths():
    lens = [2] * 10 + [40] * 3
    groups = split_by_length(lens, group_cost=5)
    assert sorted(i for g in groups for i in g) == list(range(13))  # a partition
    assert len(groups) == 2 and {frozenset(g) for g in groups} == {frozenset(range(10)), frozenset(range(10, 13))}
    # equal lengths, or a group cost above any saving: one group
    assert len(split_by_length([7] * 9)) == 1
    assert len(split_by_length(lens, group_cost=10_000)) == 1
    assert len(split_by_length(list(range(1, 300)), group_cost=1, max_groups=3)) == 3


def test_split_by_length_many_sequences_is_a_partition():
    lens = [random.Random(1).randint(1, 50) for _ in range(500)]
    groups = split_by_length(lens)
    assert sorted(i for g in groups for i in g) == list(range(500)) and len(groups) <= 4


def test_decode_kernel_matches_sdpa_on_varied_shapes():
    fn = cpu_kernels.paged_decode()
    if fn is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    gen = torch.Generator().manual_seed(3)
    for hq, hkv, d, bs in ((9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4)):
        kc, vc = torch.randn(50 * bs, hkv, d, generator=gen), torch.randn(50 * bs, hkv, d, generator=gen)
        ctx = torch.tensor([1, bs, bs + 1, 7 * bs - 3])
        tables = torch.stack([torch.randperm(50, generator=gen)[:7] for _ in range(4)])
        q = torch.randn(4, hq, d, generator=gen)
        torch.testing.assert_close(fn(q, kc, vc, tables, ctx, bs, 0.3),
                                   cpu_kernels.reference_decode(q, kc, vc, tables, ctx, bs, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_kernel_splits_long_contexts_exactly(threads):
    """Contexts of one to several of the split path's 128-token units (one unit's edge on each
    side), beside short ones, so units of one sequence land on different threads and are merged;
    block sizes whose blocks end inside a 16-token tile; every head size the path dispatches on
    (D 32/64/128) and group counts from 1 to 8; float32 and bf16 caches. The per-sequence loop
    (the path of other builds and head sizes) on the same inputs too. Where the CPU has AVX-512
    the split path must be the one taken."""
    fn, loop = cpu_kernels.paged_decode(), cpu_kernels.paged_decode_loop()
    if fn is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    if "avx512f" in isa_levels.cpu_flags():
        assert all(cpu_kernels.paged_decode_splits(d) for d in (32, 64, 128))
        assert not cpu_kernels.paged_decode_splits(16) and not cpu_kernels.paged_decode_splits(48)
    gen = torch.Generator().manual_seed(11)
    lens = [1000, 1, 127, 128, 129, 300, 17, 256]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # G = 3, 8, 5, 1, 8, 1, 4, 2, 7: every register block of the value product (up to 4 query
        # heads per KV head at D 32/64, 2 at 128) with and without a remainder
        for (hq, hkv, d), bs in zip(((9, 3, 64), (8, 1, 128), (10, 2, 128), (4, 4, 32), (16, 2, 64), (7, 7, 64),
                                     (8, 2, 32), (6, 3, 64), (14, 2, 32)),
                                    (16, 5, 32, 16, 8, 16, 16, 7, 16)):
            blocks = sum(-(-n // bs) for n in lens)
            order = torch.randperm(blocks, generator=gen)
            width = max(-(-n // bs) for n in lens)
            tables, used = torch.zeros(len(lens), width, dtype=torch.long), 0
            for b, n in enumerate(lens):
                tables[b, : -(-n // bs)] = order[used: used + -(-n // bs)]
                used += -(-n // bs)
            q = torch.randn(len(lens), hq, d, generator=gen) * 2  # sharper attention than unit scale
            kc, vc = torch.randn(blocks * bs, hkv, d, generator=gen), torch.randn(blocks * bs, hkv, d, generator=gen)
            for dt in cpu_kernels.KV_DTYPES:
                args = (q, kc.to(dt), vc.to(dt), tables, torch.tensor(lens), bs, d**-0.5)
                want = cpu_kernels.reference_decode(*args)
                for path in (fn, loop):
                    where = f"{path.__name__} hq={hq} hkv={hkv} d={d} bs={bs} {dt}"
                    torch.testing.assert_close(path(*args), want, rtol=1e-4, atol=1e-5,
                                               msg=lambda m, where=where: f"{where}: {m}")
    finally:
        torch.set_num_threads(before)


def test_decode_kernel_rejects_bad_tables():
    fn = cpu_kernels.paged_decode()
    if fn is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    kc = vc = torch.zeros(8 * 4, 1, 4)
    q = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        fn(q, kc, vc, torch.tensor([[9]]), torch.tensor([2]), 4, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        fn(q, kc, vc, torch.tensor([[0]]), torch.tensor([5]), 4, 1.0)
    empty = torch.zeros(8 * 4, 0, 4)  # no KV heads: refused, not a division by zero
    with pytest.raises(RuntimeError, match="at least one head"):
        fn(q, empty, empty, torch.tensor([[0]]), torch.tensor([2]), 4, 1.0)


def test_interleaved_rope_equals_hf_rotate_half():
    """HF rotates dim j with j + D/2; after reordering the projection rows, one complex multiply
    gives the same vector, reordered the same way (so q.k is unchanged)."""
    gen = torch.Generator().manual_seed(5)
    t, h, d = 5, 3, 8
    x = torch.randn(t, h * d, generator=gen)
    pos = torch.arange(t, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(pos, inv_freq)
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xh = x.view(t, h, d)
    rot = torch.cat((-xh[..., d // 2 :], xh[..., : d // 2]), -1)
    hf = xh * cos + rot * sin
    ours = apply_rope(interleave_rope_rows(x.t(), h, d).t().contiguous().view(t, h, d), torch.polar(torch.ones_like(angles), angles)[:, None])
    torch.testing.assert_close(ours, interleave_rope_rows(hf.reshape(t, h * d).t(), h, d).t().reshape(t, h, d), rtol=1e-5, atol=1e-6)
    # and attention scores between two rotated vectors are the same in either layout
    torch.testing.assert_close(ours @ ours.transpose(-1, -2), hf @ hf.transpose(-1, -2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_size", [16, 64])
def test_engine_output_is_the_same_with_and_without_the_kernel(tiny_model_dir, tmp_path, head_size):
    """Head size 16 (the tiny model's) takes the decode kernel's per-sequence loop, 64 its split
    path (on AVX-512 builds), with prompts long enough for contexts of several 128-token units."""
    from devtools.tiny_model import build_tiny_model
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from tests.engine_workers.engine.test_engine_hf_parity import run_together, workload

    if cpu_kernels.paged_decode() is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    model = tiny_model_dir if head_size == 16 else str(build_tiny_model(tmp_path / "d64", hidden_size=128,
                                                                        num_heads=2, num_kv_heads=1))
    on = Engine(EngineConfig(model=model, kv_cache_bytes=16 << 20))
    off = Engine(EngineConfig(model=model, kv_cache_bytes=16 << 20, cpu_kernels=False))
    assert on.runner.decode_kernel is not None and off.runner.decode_kernel is None
    assert on.runner.prefill_kernel is not None and off.runner.prefill_kernel is None
    assert on.runner.model.norm.fused is not None and off.runner.model.norm.fused is None
    reqs = workload(on.loaded.spec.vocab_size, 10, seed=11, max_prompt=150 if head_size == 16 else 400, max_new=30)
    assert run_together(on, reqs) == run_together(off, reqs)


def test_cuda_attention_policy_gives_the_same_output(tiny_model_dir):
    """What the runner does on CUDA (one padded decode group, SDPA without cuDNN: runner.py says
    why) run here on the CPU's SDPA: the same tokens as length groups with every SDPA backend."""
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.model.execution.runner import _SDPA_NO_CUDNN
    from tests.engine_workers.engine.test_engine_hf_parity import run_together, workload

    grouped = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=16 << 20, cpu_kernels=False))
    assert grouped.runner.max_decode_groups > 1 and grouped.runner.sdpa_backends is None
    cuda_like = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=16 << 20, cpu_kernels=False))
    cuda_like.runner.max_decode_groups, cuda_like.runner.sdpa_backends = 1, _SDPA_NO_CUDNN
    reqs = workload(grouped.loaded.spec.vocab_size, 10, seed=12, max_prompt=150, max_new=30)
    assert run_together(cuda_like, reqs) == run_together(grouped, reqs)


def test_flag_and_env_turn_the_kernel_off(monkeypatch):
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).cpu_kernels is True
    assert engine_config_from_args(build_parser().parse_args(["generate", "--no-cpu-kernels", "hi"])).cpu_kernels is False
    monkeypatch.setenv("LOCKGATE_NO_CPU_KERNELS", "1")
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).cpu_kernels is False
    assert cpu_kernels._resolve() == (None, "off (LOCKGATE_NO_CPU_KERNELS)")
    assert cpu_kernels._resolve_prefill() == (None, "off (LOCKGATE_NO_CPU_KERNELS)")
    assert cpu_kernels._resolve_small_m() == (None, "off (LOCKGATE_NO_CPU_KERNELS)")
    assert cpu_kernels._resolve_fused() == (None, "off (LOCKGATE_NO_CPU_KERNELS)")


# --- fused elementwise kernels (csrc/fused_elementwise.cpp) ------------------------------------------

@pytest.mark.parametrize("t, h", [(1, 8), (7, 576), (300, 100)])
def test_fused_add_rms_norm_and_silu_mul_match_torch(t, h):
    from engine_workers.model.models.llama import RMSNorm

    ops = cpu_kernels.fused()
    if ops is None:
        pytest.skip(f"no fused CPU kernels here: {cpu_kernels.fused_problem()}")
    gen = torch.Generator().manual_seed(t + h)
    norm = RMSNorm(h, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=gen))
    res, delta = torch.randn(t, h, generator=gen) * 4, torch.randn(t, h, generator=gen)
    plain_res, fused_res = res.clone(), res.clone()
    want = norm.add_forward(plain_res, delta)  # torch path: in-place add, then the norm
    norm.fused = ops.add_rms_norm
    got = norm.add_forward(fused_res, delta)
    torch.testing.assert_close(fused_res, res + delta)  # the residual stream advanced in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.add_forward(fused_res.clone(), None), norm(fused_res), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(t, 2 * h, generator=gen) * 30  # saturating values too
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :h]) * gate_up[:, h:], rtol=1e-5, atol=1e-4)


def test_fused_kernels_reject_bad_inputs():
    ops = cpu_kernels.fused()
    if ops is None:
        pytest.skip(f"no fused CPU kernels here: {cpu_kernels.fused_problem()}")
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_rms_norm(torch.randn(3, 8), None, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        ops.add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_mul(torch.randn(3, 7))


def test_stale_kernel_builds_are_pruned_and_the_current_one_kept(tmp_path):
    import os

    current, fresh, stale, other = (tmp_path / n for n in ("cpu_kernels-cur", "cpu_kernels-new", "cpu_kernels-old",
                                                          "bench_reader-old"))
    for d in (current, fresh, stale, other):
        d.mkdir()
        (d / "lib.so").write_bytes(b"x")
    now = 2_000_000_000.0
    for d in (current, stale, other):
        os.utime(d, (now - cpu_kernels.STALE_BUILD_S - 60,) * 2)
    os.utime(fresh, (now - 60,) * 2)
    removed = cpu_kernels._prune_stale(current, now=now)
    assert removed == [stale]  # only an old build of this module; not ours, not a fresh one, not others
    assert current.exists() and fresh.exists() and other.exists() and not stale.exists()
