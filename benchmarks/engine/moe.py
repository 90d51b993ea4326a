"""``lockgate bench moe``: grouped MoE execution against transformers' MoE and a dense MLP of the
same active parameters.

Two parts, same machine, same process:

- **block**: one MoE layer on ``T`` tokens. Peers on the same weights and inputs: ``grouped``
  (:class:`engine_workers.model.models.moe.SparseMoeBlock`: tokens sorted by expert, one GEMM pair per
  active expert), ``hf`` (transformers' ``Qwen3MoeSparseMoeBlock``, its default experts
  implementation), ``dense`` (one gated MLP of intermediate ``top_k * I``: what the same active
  parameters cost without routing). Best of ``--rounds`` rounds, peers alternated.
- **engine**: a small random Qwen3-MoE checkpoint generating greedily through lockgate's engine
  and through transformers' batched ``generate``, and a dense Qwen3 of equal active parameters
  through lockgate's engine; tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lockgate.options import env_default


@dataclass(frozen=True, slots=True)
class MoeShape:
    hidden: int = 512
    inter: int = 256  # each expert's
    experts: int = 16
    top_k: int = 2


@dataclass(frozen=True, slots=True)
class BlockRow:
    tokens: int
    ms: dict[str, float]  # peer -> best ms per layer call


@dataclass(frozen=True, slots=True)
class EngineRow:
    peer: str
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _best(fn, x, rounds: int, reps: int) -> float:
    import torch

    best = float("inf")
    with torch.inference_mode():
        fn(x)  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def bench_block(shape: MoeShape, token_counts: tuple[int, ...], rounds: int) -> list[BlockRow]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from engine_workers.model.models.moe import RouterSpec, SparseMoeBlock

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=shape.hidden, num_experts=shape.experts,
                               num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.inter,
                               norm_topk_prob=True)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()  # type: ignore[arg-type]
    for p in hf.parameters():
        p.data.normal_(0, 0.05)
    ours = SparseMoeBlock(shape.hidden, shape.inter, RouterSpec("softmax_topk", shape.experts, shape.top_k)).eval()
    ours.router.weight.data = hf.gate.weight.data
    assert ours.experts.gate_up is not None and ours.experts.down is not None  # stacked: no use_linears
    ours.experts.gate_up.data = hf.experts.gate_up_proj.data
    ours.experts.down.data = hf.experts.down_proj.data
    dense_inter = shape.top_k * shape.inter
    w_gate_up = torch.randn(2 * dense_inter, shape.hidden) * 0.05
    w_down = torch.randn(shape.hidden, dense_inter) * 0.05

    def dense(x):
        g, u = F.linear(x, w_gate_up).split(dense_inter, dim=-1)
        return F.linear(F.silu(g) * u, w_down)

    peers = {"grouped": ours, "hf": lambda x: hf(x.unsqueeze(0)), "dense": dense}
    rows = []
    for t in token_counts:
        x = torch.randn(t, shape.hidden)
        with torch.inference_mode():  # the peers compute the same layer (dense aside)
            torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], rtol=1e-4, atol=1e-4)
        reps = max(2, 256 // t)
        best = {name: float("inf") for name in peers}
        for _ in range(rounds):
            for name, fn in peers.items():
                best[name] = min(best[name], _best(fn, x, 1, reps))
        rows.append(BlockRow(t, best))
    return rows


def _save(model_type: str, out: Path, **kw) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from devtools.tiny_model import build_tokenizer

    tok = build_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=512, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bench_engine(shape: MoeShape, seqs: int, prompt_len: int, new_tokens: int) -> list[EngineRow]:
    import random

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(prompt_len)] for _ in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    total = seqs * new_tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        moe = _save("qwen3_moe", Path(tmp) / "moe", hidden_size=shape.hidden, intermediate_size=shape.inter,
                    num_experts=shape.experts, num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.inter,
                    norm_topk_prob=True)
        dense = _save("qwen3", Path(tmp) / "dense", hidden_size=shape.hidden,
                      intermediate_size=shape.top_k * shape.inter)
        for peer, path in (("lockgate moe", moe), ("lockgate dense", dense)):
            engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=64 << 20, block_size=16))
            engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            rows.append(EngineRow(peer, total, time.perf_counter() - t0))
        hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
        gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        ids = torch.tensor(prompts)  # equal lengths: one batch, no padding
        with torch.inference_mode():
            hf.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, do_sample=False)
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            rows.append(EngineRow("transformers moe", total, time.perf_counter() - t0))
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.machine import describe, machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = MoeShape(args.hidden, args.inter, args.experts, args.top_k)
    tokens = tuple(int(t) for t in str(args.tokens).split(","))
    block = bench_block(shape, tokens, args.rounds)
    engine = [] if args.no_engine else bench_engine(shape, args.seqs, args.prompt_len, args.new_tokens)
    if args.json:
        print(json.dumps({"machine": machine_info(), "shape": asdict(shape), "threads": torch.get_num_threads(),
                          "block": [asdict(r) for r in block],
                          "engine": [{**asdict(r), "tok_s": r.tok_s} for r in engine]}))
        return 0
    print(describe(machine_info()))
    print(f"shape {asdict(shape)}, {torch.get_num_threads()} threads")
    print("MoE layer, ms per call (best of rounds):")
    print(f"{'tokens':>7} {'grouped':>9} {'hf':>9} {'dense':>9} {'hf/grouped':>11} {'grouped/dense':>14}")
    for r in block:
        g, h, d = r.ms["grouped"], r.ms["hf"], r.ms["dense"]
        print(f"{r.tokens:>7} {g:>9.3f} {h:>9.3f} {d:>9.3f} {h / g:>11.2f} {g / d:>14.2f}")
    if engine:
        print(f"greedy generation, {args.seqs} sequences x {args.new_tokens} tokens after {args.prompt_len}-token prompts:")
        base = next(r.tok_s for r in engine if r.peer == "lockgate moe")
        for e in engine:
            print(f"  {e.peer:<18} {e.tok_s:>8.1f} tok/s  ({e.tok_s / base:.2f}x lockgate moe)")
    return 0


def add_args(b: argparse.ArgumentParser) -> None:
    d = MoeShape()
    b.add_argument("--hidden", type=int, default=env_default("moe_hidden", d.hidden),
                   help=f"hidden size (default {d.hidden}) [LOCKGATE_MOE_HIDDEN]")
    b.add_argument("--inter", type=int, default=env_default("moe_inter", d.inter),
                   help=f"each expert's intermediate size (default {d.inter}) [LOCKGATE_MOE_INTER]")
    b.add_argument("--experts", type=int, default=env_default("moe_experts", d.experts),
                   help=f"experts (default {d.experts}) [LOCKGATE_MOE_EXPERTS]")
    b.add_argument("--top-k", type=int, default=env_default("moe_top_k", d.top_k),
                   help=f"experts per token (default {d.top_k}) [LOCKGATE_MOE_TOP_K]")
    b.add_argument("--tokens", default=env_default("moe_tokens", "1,16,128,1024"),
                   help="comma-separated layer batch sizes (default 1,16,128,1024) [LOCKGATE_MOE_TOKENS]")
    b.add_argument("--rounds", type=int, default=env_default("moe_rounds", 3),
                   help="rounds, peers alternated, each keeps its best (default 3) [LOCKGATE_MOE_ROUNDS]")
    b.add_argument("--seqs", type=int, default=env_default("moe_seqs", 8),
                   help="engine part: sequences (default 8) [LOCKGATE_MOE_SEQS]")
    b.add_argument("--prompt-len", type=int, default=env_default("moe_prompt_len", 32),
                   help="engine part: prompt tokens (default 32) [LOCKGATE_MOE_PROMPT_LEN]")
    b.add_argument("--new-tokens", type=int, default=env_default("moe_new_tokens", 32),
                   help="engine part: tokens generated per sequence (default 32) [LOCKGATE_MOE_NEW_TOKENS]")
    b.add_argument("--no-engine", action="store_true", default=env_default("moe_no_engine", False),
                   help="only the layer part [LOCKGATE_MOE_NO_ENGINE]")
    b.add_argument("--threads", type=int, default=env_default("moe_threads", 0),
                   help="torch threads (default 0: torch's own) [LOCKGATE_MOE_THREADS]")
    b.add_argument("--json", action="store_true", help="print one JSON object")
