"""CUDA graphs of the decode step (engine_workers/model/execution/cudagraph): a replay gives bit for bit the
logits of the same padded inputs run eager, a served workload's greedy tokens equal
``enforce_eager``'s in float32, decode steps do replay, and what is not capturable runs eager.
Needs CUDA; skipped without it. Written without a GPU: not yet run on one (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.cudagraph.buckets import pad, plan
from lockgate_types import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(path: str, dtype: str, eager: bool) -> Engine:
    return Engine(EngineConfig(model=path, device="cuda", dtype=dtype, kv_cache_bytes=64 << 20, max_num_seqs=16,
                               enforce_eager=eager))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_equals_eager_on_the_same_padded_inputs(tiny_model_dir, dtype):
    engine = _engine(tiny_model_dir, dtype, eager=False)
    runner = engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.graphs, "graphs captured at start"
    bs = runner.block_size
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 33)]
    tables = [[0], [1, 2], [3, 4, 5]]
    for p, t in zip(prompts, tables):
        runner.execute(ModelInput((Chunk(p, 0, t, True),)))  # prefill: eager
    step = tuple(Chunk([11], len(p), t, True) for p, t in zip(prompts, tables))
    key = plan(step, bs, graphs.batches, graphs.widths).key
    assert key is not None
    replayed = runner.execute(ModelInput(step)).logits
    assert graphs.counts["replay"] == 1
    _graph, s, _out = graphs.graphs[key]
    s.load(pad(step, key, bs, graphs.dummy))
    with torch.inference_mode():
        eager = graphs.forward(s)[:3]  # the same kernels, launched one by one
    assert torch.equal(replayed, eager)


def test_greedy_tokens_equal_enforce_eager_and_decodes_replay(tiny_model_dir):
    prompts = [[5, 6, 7], list(range(10, 50)), list(range(60, 75)), [9] * 70]
    got = {}
    for eager in (True, False):
        engine = _engine(tiny_model_dir, "float32", eager)
        got[eager] = [list(o.token_ids) for o in engine.generate(prompts, GREEDY)]
        if eager:
            assert engine.runner.graphs is None
        else:
            assert engine.runner.graphs is not None and engine.runner.graphs.counts["replay"] > 0
    assert got[False] == got[True]


def test_memory_gauge_reports_the_device(tiny_model_dir):
    from engine_workers.model.execution.runner import gpu_memory_utilization

    _engine(tiny_model_dir, "bfloat16", eager=True)
    used = gpu_memory_utilization(torch.device("cuda"))
    assert used is not None and 0.0 < used <= 1.0


def test_bench_step_breakdown_host_and_device(tiny_model_dir):
    import time

    from benchmarks.engine.steptime import StepTimer

    engine = _engine(tiny_model_dir, "bfloat16", eager=False)
    timer = StepTimer(engine.runner)
    t0 = time.perf_counter()
    engine.generate([[5, 6, 7], list(range(10, 50))], GREEDY)
    sb = timer.close(time.perf_counter() - t0)
    assert sb["forwards"] >= GREEDY.max_tokens  # one prefill step, then a decode step per token
    assert sb["forward_host_ms"] > 0 and sb["forward_device_ms"] > 0
    assert sb["graph_counts"].get("replay", 0) > 0
    assert engine.runner.execute.__func__ is type(engine.runner).execute  # restored
