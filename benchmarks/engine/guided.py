"""Decode throughput with and without structured output: the same batch of chat requests, sampled,
unconstrained vs constrained by a JSON schema (xgrammar masks, engine.guided).

    python -m benchmarks.engine.guided [--model M] [--batch 16] [--max-tokens 128] [--repeat 3]

Prints one JSON line per mode: generated tokens, seconds, tokens/s (best of ``--repeat``), and the
mask stage's share. The schema's grammar is compiled before timing (as the worker's cache would).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                      "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"]},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
}


def run(model: str, batch: int, max_tokens: int, repeat: int, threads: int) -> list[dict[str, Any]]:
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    engine = Engine(EngineConfig(model=model, max_num_seqs=batch, num_threads=threads))
    prompt = engine.encode_prompt(messages=[{"role": "user", "content": "Invent a user profile as JSON."}])
    schema = json.dumps(SCHEMA)
    engine.grammars().compile(("json", schema))
    masks = engine._masks
    apply, mask_s = masks.apply, [0.0]

    def timed(logits: Any, guided: Any, ahead: Any = None) -> None:  # the mask stage's own time (bitmask fill + apply)
        t = time.perf_counter()
        apply(logits, guided, ahead)
        mask_s[0] += time.perf_counter() - t

    masks.apply = timed  # type: ignore[method-assign]  # instrumented for this bench: times the mask stage
    out = []
    for mode in ("plain", "json_schema"):
        best: dict[str, Any] | None = None
        for r in range(repeat):
            extra = {"guided_json": schema} if mode == "json_schema" else {"ignore_eos": True}
            params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 * r + i, **extra)
                      for i in range(batch)]
            mask_s[0] = 0.0
            steps0 = engine.stats.steps
            t0 = time.perf_counter()
            done = engine.generate([prompt] * batch, params)
            dt = time.perf_counter() - t0
            tokens = sum(len(d.token_ids) for d in done)
            res = {"mode": mode, "batch": batch, "tokens": tokens, "seconds": round(dt, 3),
                   "tokens_per_s": round(tokens / dt, 1), "steps": engine.stats.steps - steps0,
                   "mask_s": round(mask_s[0], 4), "mask_share": round(mask_s[0] / dt, 4),
                   "finished": sorted({d.finish_reason for d in done})}
            if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
                best = res
        assert best is not None
        out.append(best)
        print(json.dumps(best), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from tokenization.model_store import ensure_default_model

        model = str(ensure_default_model())
    run(model, args.batch, args.max_tokens, args.repeat, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
