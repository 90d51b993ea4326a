"""The ``lockgate`` command line: one entry point, subcommands registered by each package.

Each package has a ``commands`` module with ``register(sub, bench)``: ``sub`` takes top-level
subcommands, ``bench`` takes ``lockgate bench <name>``. Those modules import nothing heavy at
module level (torch, transformers, aiokafka load inside the command), so ``lockgate --help`` is fast.
Every flag has an environment variable twin ``LOCKGATE_<FLAG>`` (see README, Configuration).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMAND_MODULES = (
    "engine_workers.commands",
    "bus.commands",
    "edge.commands",
    "producers.commands",
)


def run_loop(coro):  # noqa: ANN001, ANN201
    """Run ``coro`` to completion on uvloop when installed, else the default asyncio loop; returns
    its result. Every long-running command (edge, worker, serve) and the benchmarks use it."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


GC_GEN0_THRESHOLD = 50_000  # allocations minus frees between young collections (CPython: 700)


def freeze_heap() -> None:
    """Move every object alive now into the garbage collector's permanent generation.

    Called once a server has started (modules imported, tokenizer/model loaded) and before it
    takes traffic. Those millions of long-lived objects are otherwise re-traversed by every full
    (gen-2) collection, a stop-the-world pause. Frozen objects are still freed by reference counting; only cycles among them are
    never collected, which is fine for start-up state that lives as long as the process."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    # At exit, hand them back before the interpreter finalizes: frozen cycles are never freed,
    # and torch's triton bindings (nanobind) then print ~30 lines of "leaked instances/types"
    # after every clean shutdown of a server. Registered once however often this is called.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    # Objects created after start-up (10,000 connections' state) are long-lived too; with the
    # default thresholds (700, 10, 10) the young generations are collected every few hundred
    # allocations and a full collection traverses every connection (473 ms pauses at 10,000,
    # measured by `lockgate bench edge`: its whole p99 tail). Reference counting frees nearly everything a server allocates
    # per frame, so collecting far less often costs little memory and takes the pauses away.
    gc.set_threshold(GC_GEN0_THRESHOLD, 50, 1000)


def env_default(name: str, default: object) -> object:
    """Default for flag ``--name``: env ``LOCKGATE_NAME`` if set, else ``default``."""
    key = "LOCKGATE_" + name.upper().replace("-", "_")
    raw = os.environ.get(key)
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


class _DefaultsHelp(argparse.HelpFormatter):
    """``--help`` shows each flag's default, as it applies now (a ``LOCKGATE_*`` variable set in
    the environment is the default): unless the help text already names one, or there is none to
    show (``None``, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower() or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every parser of the CLI, subcommands included (``add_subparsers`` makes its parsers of its
    parent's class), formats help with :class:`_DefaultsHelp`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lockgate", description="lockgate LLM inference platform")
    parser.add_argument("--log-level", default=env_default("log-level", "INFO"), help="logging level (env LOCKGATE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = sub.add_parser("bench", help="benchmarks (print measured figures)")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCH")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        # websockets logs "connection open" / "connection closed" at INFO for every connection: an
        # edge holding 10,000 clients would print 20,000 lines per reconnect wave, formatted on its
        # event loop. The edge's metrics count connections; DEBUG brings the lines back.
        logging.getLogger("websockets").setLevel(logging.WARNING)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from bus.base import BusError

    try:
        rc = func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # user input: say what was wrong, no traceback
        print(f"lockgate: error: {exc}", file=sys.stderr)
        return 2
    except BusError as exc:  # the bus failed (broker unreachable, ...): its message names what and where
        if level <= logging.DEBUG:
            logging.getLogger("lockgate").exception("bus error")
        print(f"lockgate {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
