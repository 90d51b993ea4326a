"""Speculative decoding (n-gram or a draft model) vs plain decoding, on three workloads.

    lockgate bench spec [--model M] [--batches 1,4,32] [--workload repetitive,heldout,chat]
        [--max-tokens 128] [--repeat 2] [--draft-layers N]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}']
    python -m benchmarks.engine.spec ...   (the same)

Workloads: ``repetitive`` asks the model to summarise passages quoting them (prompt lookup's
case; the passages the n-gram settings were chosen on); ``heldout`` are other prompts that quote
their input (edit this code, correct this text, list these items), never used for tuning;
``chat`` are ordinary questions whose answers quote nothing. ``--draft-layers N`` speculates with
a draft model instead: the target's first ``N`` layers with its final norm and head, written as a
checkpoint of their own (a smaller model with the same tokenizer; the only one at hand offline).

Two engines of the same model, one plain and one with ``--speculative-config``, run the same
requests alternately (``--repeat`` rounds, best round kept). Per batch size and mode: TPOT (mean
over requests of (last token - first token) / (tokens - 1)), output tokens/s over the batch's wall
time, and for the speculative engine the acceptance rate (accepted / proposed tokens) and the
mean tokens per verification (1 + accepted / drafts). Every request's tokens are compared between
the modes: ``identical`` must be true (speculation changes nothing but speed). One JSON line per
(batch, mode), then the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PASSAGES = [
    "The city council met on Tuesday to discuss the new bicycle lanes. The plan adds twelve kilometres of "
    "protected lanes along the river and closes two car parks in the old town. Shop owners asked for more "
    "delivery zones, and the council agreed to review the plan in six months.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, where chlorophyll absorbs red and blue light. The sugar feeds the plant, "
    "and the oxygen is released into the air through small pores in the leaves.",
    "The library will close for renovation from the first of March to the end of June. During that time "
    "books can be returned at the town hall, and the children's reading club will meet in the community "
    "centre on Saturday mornings. The new library will have a larger study room and a cafe.",
    "A hash table stores key and value pairs in an array of buckets. A hash function maps each key to a "
    "bucket, and collisions are handled by chaining or by open addressing. Lookups take constant time on "
    "average, but a poor hash function can make every key land in the same bucket.",
]


# Held out: never used to choose the n-gram settings; each quotes its input in its answer.
HELD_OUT = [
    "Add a docstring to this Python function and return the whole function unchanged otherwise:\n\n"
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(total / window)\n    return out",
    "Correct the spelling mistakes in this paragraph and write it out again in full: The comittee has decided "
    "to postpone the anual meeting untill the new building is finnished. All members will recieve an email with "
    "the new date, and the agenda will be sent seperately a week before the meeting.",
    "Turn these notes into a numbered list, keeping each item's wording: buy flour and eggs; call the plumber "
    "about the kitchen sink; return the library books before Friday; book the train tickets to Leeds; water "
    "the plants on the balcony.",
    "Rename the variable x to count everywhere in this code and show the result:\n\n"
    "x = 0\nfor line in open('log.txt'):\n    if 'error' in line:\n        x += 1\nprint('errors:', x)\n"
    "if x > 10:\n    print('too many errors, x =', x)",
]

CHAT = [
    "Why is the sky blue?", "Give me three tips for sleeping better.", "What is a good name for a grey cat?",
    "Explain what a compiler does in two sentences.", "Write a haiku about the sea.",
    "What should I pack for a weekend of hiking?", "How do I make a cup of green tea?",
    "What is the difference between weather and climate?",
]

WORKLOADS = ("repetitive", "heldout", "chat")


def prompt_messages(i: int, workload: str = "repetitive") -> list[dict[str, str]]:
    if workload == "heldout":
        return [{"role": "user", "content": HELD_OUT[i % len(HELD_OUT)]}]
    if workload == "chat":
        return [{"role": "user", "content": CHAT[i % len(CHAT)]}]
    text = PASSAGES[i % len(PASSAGES)]
    return [{"role": "user", "content": "Summarise the following passage, quoting its most important sentences "
                                        f"word for word.\n\nPassage:\n{text}"}]


def truncated_draft(model: str | None, layers: int, out: Path) -> Path:
    """A draft checkpoint of the target's first ``layers`` layers, its final norm, head and tokenizer."""
    from safetensors.torch import load_file, save_file

    from tokenization.model_store import resolve_model

    src = resolve_model(model)
    assert isinstance(src, Path), "--draft-layers needs a local checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= layers < cfg["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in [1, {cfg['num_hidden_layers']}), got {layers}")
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                continue
            state[name] = t.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _round(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from lockgate_types import SamplingParams

    stats = engine.stats
    d0, t0, a0 = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    tokens: dict[str, list[int]] = {}
    tpots = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        tokens[rid] = []
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished and out.times is not None and out.num_output_tokens > 1:
                t = out.times
                tpots.append((t.last_token - t.first_token) / (out.num_output_tokens - 1))
    wall = time.perf_counter() - start
    generated = sum(len(v) for v in tokens.values())
    drafts, proposed, accepted = (stats.spec_num_drafts - d0, stats.spec_num_draft_tokens - t0,
                                  stats.spec_num_accepted_tokens - a0)
    return {"wall_s": wall, "tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "generated": generated,
            "tok_s": generated / wall, "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
            "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted}


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.engine.speculative import SpeculativeConfig

    spec = args.speculative_config or SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                                                        prompt_lookup_max=4)
    if args.draft_layers:
        where = Path(tempfile.mkdtemp(prefix="lockgate-draft-"))
        draft = truncated_draft(args.model, args.draft_layers, where)
        spec = SpeculativeConfig(num_speculative_tokens=spec.num_speculative_tokens, method="draft_model",
                                 model=str(draft), disable_by_batch_size=spec.disable_by_batch_size)
    batches = [int(b) for b in str(args.batches).split(",")]
    base = dict(model=args.model, num_threads=args.threads, max_num_seqs=max(batches))
    engines = {"plain": Engine(EngineConfig(**base)), "spec": Engine(EngineConfig(**base, speculative_config=spec))}
    rows = []
    workloads = str(args.workload).split(",")
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"--workload {bad[0]!r}: expected one or more of {', '.join(WORKLOADS)}")
    for workload, b in ((w, b) for w in workloads for b in batches):
        prompts = [engines["plain"].encode_prompt(messages=prompt_messages(i, workload)) for i in range(b)]
        for e in engines.values():  # warm-up: first-step costs (allocations, oneDNN plans) out of the timing
            _round(e, prompts[:1], 4)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeat):
            for mode, e in engines.items():
                got = _round(e, prompts, args.max_tokens)
                if mode not in best or got["wall_s"] < best[mode]["wall_s"]:
                    best[mode] = got
        identical = best["plain"]["tokens"] == best["spec"]["tokens"]
        for mode, got in best.items():
            name = spec.method if mode == "spec" else mode
            row: dict[str, Any] = {"batch": b, "workload": workload, "mode": name, "generated": got["generated"],
                                   "wall_s": round(got["wall_s"], 3), "tok_s": round(got["tok_s"], 2),
                                   "tpot_ms": round(got["tpot_ms"], 2) if got["tpot_ms"] is not None else None,
                                   "identical": identical}
            if mode == "spec":
                row["drafts"] = got["drafts"]  # 0: nothing speculated (e.g. above disable_by_batch_size)
                row["acceptance_rate"] = round(got["accepted_tokens"] / max(1, got["draft_tokens"]), 3)
                row["tokens_per_verification"] = round(1 + got["accepted_tokens"] / max(1, got["drafts"]), 3)
                row["speedup_tok_s"] = round(got["tok_s"] / best["plain"]["tok_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    from lockgate.options import speculative_arg

    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--workload", default="repetitive",
                   help="comma-separated: repetitive (quotes its prompt), heldout (other quoting prompts), chat")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="speculate with a draft model: the target's first N layers (0 = the config's method)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2, help="rounds per (batch, mode); the fastest is kept")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--speculative-config", type=speculative_arg, default=None,
                   help="the speculative engine's config (default: ngram, k=4, lookup 2..4)")


def run(args: argparse.Namespace) -> int:
    from benchmarks.machine import describe, machine_info

    rows = run_bench(args)
    print(describe(machine_info()))
    return 0 if all(r["identical"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
