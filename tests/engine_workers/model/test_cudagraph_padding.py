"""The CUDA-graph decode path's inputs, on a CPU: a decode step padded to a graph's bucket and run
through the metadata built from the graph's static buffers (engine_workers/model/execution/cudagraph/graphs.py)
gives the eager step's logits for the real rows, writes the same K/V, and its padded rows touch
nothing but the dummy block. The capture and replay themselves need CUDA (test_cudagraph_gpu.py)."""

from __future__ import annotations

import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.cudagraph.buckets import batch_buckets, pad, plan, width_buckets
from engine_workers.model.execution.cudagraph.graphs import DecodeGraphs, Static, graph_problem, static_metadata
from engine_workers.model.execution.runner import ModelRunner
from lockgate_types import SamplingParams


def _runner(engine: Engine) -> ModelRunner:
    # the gather + SDPA decode path, as on CUDA, and one block more than the pool: the dummy block
    r = engine.runner
    assert isinstance(r, ModelRunner)
    return ModelRunner(engine.loaded, r.num_blocks + 1, r.block_size, r.device, r.dtype, cpu_kernels=False)


def test_padded_static_decode_equals_eager(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 20, cpu_kernels=False))
    runner = _runner(engine)
    bs, dummy = runner.block_size, runner.num_blocks - 1
    assert graph_problem(runner.model) is None  # the tiny Llama is capturable
    g = torch.Generator().manual_seed(3)
    # three sequences prefilled eagerly: 5, 20 and 33 tokens in blocks of their own
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 20, 33)]
    tables = [[0], [1, 2], [3, 4, 5]]
    for p, t in zip(prompts, tables):
        runner.execute(ModelInput((Chunk(p, 0, t, True),)))
    step = tuple(Chunk([11], len(p), t, True) for p, t in zip(prompts, tables))
    verdict = plan(step, bs, batch_buckets(8), width_buckets(4))
    assert verdict.key == (4, 4)  # three rows padded to four, three blocks to four

    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = runner.execute(ModelInput(step)).logits
    after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # rewind to before the step
        k.copy_(k0)
        v.copy_(v0)

    s = Static(*verdict.key, runner.device)
    s.load(pad(step, verdict.key, bs, dummy))
    with torch.inference_mode():
        logits = runner.model(s.ids, s.positions, runner.kv_caches, static_metadata(s, bs, runner.dtype), s.rows)
    assert logits.shape[0] == 4
    torch.testing.assert_close(logits[:3], eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[:3].argmax(-1), eager.argmax(-1))
    # the same K/V everywhere but the dummy block, which only the padded row wrote
    pool = slice(0, dummy * bs)
    for (k, v), (ke, ve), (k0, _) in zip(runner.kv_caches, after_eager, before):
        assert torch.equal(k[pool], ke[pool]) and torch.equal(v[pool], ve[pool])
        assert not torch.equal(k[dummy * bs:], k0[dummy * bs:])


def test_graphs_only_on_cuda_and_the_flag_is_accepted_on_cpu(tiny_model_dir):
    from lockgate.cli import build_parser
    from lockgate.options import engine_config_from_args

    for cmd in (["serve"], ["worker"], ["bench", "engine"]):
        assert engine_config_from_args(build_parser().parse_args(cmd)).enforce_eager is False
        assert engine_config_from_args(build_parser().parse_args([*cmd, "--enforce-eager"])).enforce_eager is True
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 20, enforce_eager=eager))
        assert engine.runner.graphs is None  # a CPU never captures
        outs.append([list(o.token_ids) for o in engine.generate(["hello there"], greedy)])
    assert outs[0] == outs[1]


def test_run_reports_eager_steps_without_a_graph():
    graphs = DecodeGraphs(torch.nn.Identity(), [], 16, 9, torch.float32, torch.device("cpu"), 8, 64)
    assert graphs.run([([1, 2], 0, [0], True)]) is None  # prefill: eager
    assert graphs.run([([1], 3, [0], True)]) is None  # nothing captured on a CPU: eager
    assert graphs.counts == {"prefill or mixed step": 1, "not captured": 1}
    assert graph_problem(torch.nn.Identity()) == "Identity is not the paged decoder"


def test_gpu_memory_gauge_absent_on_cpu_set_from_a_cuda_snapshot():
    from engine_workers.engine.async_engine import EngineSnapshot
    from engine_workers.model.execution.runner import gpu_memory_utilization
    from engine_workers.worker.health.metrics import WorkerMetrics

    assert gpu_memory_utilization(torch.device("cpu")) is None
    m = WorkerMetrics("m")
    m.observe_snapshot(EngineSnapshot(), (0, 0, 0), (0, 0, 0))
    assert b"lockgate:gpu_memory_utilization{" not in m.render()
    m.observe_snapshot(EngineSnapshot(gpu_memory_utilization=0.375), (0, 0, 0), (0, 0, 0))
    assert b'lockgate:gpu_memory_utilization{model="m"} 0.375' in m.render()
