"""CLI commands of the engine package: ``generate``, ``model`` (``lockgate bench engine`` is :mod:`benchmarks.cli`'s).

Nothing heavy is imported at module level: torch/transformers load inside the commands.
"""

from __future__ import annotations

import argparse
import sys

from lockgate.options import add_engine_args, engine_config_from_args, env_default


def _generate(args: argparse.Namespace) -> int:
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop or ()))
    engine = Engine(engine_config_from_args(args))
    chat = not args.raw and getattr(engine.tokenizer, "chat_template", None)
    if chat:
        engine.add_request("cli", params=params, messages=[{"role": "user", "content": args.prompt}])
    else:
        engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                print(f"[finish={out.finish_reason} prompt={out.num_prompt_tokens} completion={out.num_output_tokens}]", file=sys.stderr)
    return 0


def _model_fetch(args: argparse.Namespace) -> int:
    from tokenization.model_store import resolve_model

    print(resolve_model(args.model))
    return 0


def _model_tiny(args: argparse.Namespace) -> int:
    try:
        from devtools.tiny_model import build_tiny_model  # a dev tool: a source checkout has it, the wheel does not
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "devtools":
            raise
        raise ValueError("`lockgate model tiny` is a development tool: it runs from a source checkout (`make install`)") from None

    print(build_tiny_model(args.out, num_layers=args.layers))
    return 0


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

    m = sub.add_parser("model", help="model checkpoints")
    msub = m.add_subparsers(dest="model_cmd", metavar="ACTION")
    f = msub.add_parser("fetch", help="make the model loadable (converts the default SmolLM2 once) and print its folder")
    f.add_argument("--model", default=env_default("model", "default"))
    f.set_defaults(func=_model_fetch)
    t = msub.add_parser("tiny", help="write a tiny random Llama checkpoint (tests, demos)")
    t.add_argument("out")
    t.add_argument("--layers", type=int, default=2)
    t.set_defaults(func=_model_tiny)
