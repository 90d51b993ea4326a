"""The ``lockgate`` command line: one entry point, subcommands registered by each package.

Each package has a ``commands`` module with ``register(sub, bench)``: ``sub`` takes top-level
subcommands, ``bench`` takes ``lockgate bench <name>``. Those modules import nothing heavy at
module level (torch, transformers, aiokafka load inside the command), so ``lockgate --help`` is fast.
Every flag has an environment variable twin ``LOCKGATE_<FLAG>`` (see README, Configuration).

The product's command modules are imported here by name, so the import graph (and its contracts)
sees every edge. Tools plug in the other way round: a distribution declares ``register`` functions
under the ``lockgate.commands`` entry point group (pyproject.toml: ``bench = benchmarks.cli:register``),
so the benchmarks import the CLI's flag helpers and the CLI never imports the benchmarks. The wheel
leaves the benchmarks out (they run from a source checkout); there ``lockgate bench`` says so. A
checkout that is not installed has no entry points: ``python -m benchmarks ...`` is this CLI with the
benchmarks passed in (``main(argv, plugins)``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from lockgate import serve
from lockgate.commands import bus, edge, engine, producers, worker
from lockgate.options import env_default
from lockgate.telemetry import add_tracing_flags

COMMANDS = (engine, worker, serve, bus, edge, producers)
Register = Callable[[argparse._SubParsersAction, argparse._SubParsersAction], None]  # a plugin's ``register(sub, bench)``
PLUGIN_GROUP = "lockgate.commands"  # entry points: ``name = "module:register"``, loaded after COMMANDS
BENCH_MISSING = ("the benchmarks are not installed: they run from a source checkout "
                 "(`make install`, then `lockgate bench ...`; docs/benchmarks.md)")


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # argparse.ArgumentParser's, passed on
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)


def build_parser(plugins: Sequence[Register] = ()) -> argparse.ArgumentParser:
    """The whole CLI: the product's commands, then ``plugins`` (a caller's own, e.g. ``python -m
    benchmarks`` in a checkout that is not installed), then the installed ``lockgate.commands`` entry
    points not among ``plugins``."""
    parser = _Parser(prog="lockgate", description="lockgate LLM inference platform")
    parser.add_argument("--log-level", default=env_default("log-level", "INFO"), help="logging level (env LOCKGATE_LOG_LEVEL)")
    parser.add_argument("--log-format", default=env_default("log-format", "text"), choices=("text", "json"),
                        help="log lines as text or one JSON object per line with request and trace ids "
                             "(env LOCKGATE_LOG_FORMAT)")
    add_tracing_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = sub.add_parser("bench", help="benchmarks (print measured figures)")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCH")
    for module in COMMANDS:
        module.register(sub, bench)
    registers = list(plugins)
    for plugin in entry_points(group=PLUGIN_GROUP):
        try:
            register = plugin.load()
        except ModuleNotFoundError as exc:
            # declared by the distribution, absent from this install (the wheel ships no tools)
            if exc.name is None or not (plugin.module == exc.name or plugin.module.startswith(exc.name + ".")):
                raise
            continue
        if register not in registers:
            registers.append(register)
    for register in registers:
        register(sub, bench)
    if not bench.choices:
        bench_parser.set_defaults(func=_bench_missing)
    return parser


def _bench_missing(_args: argparse.Namespace) -> int:
    print(f"lockgate bench: error: {BENCH_MISSING}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, plugins: Sequence[Register] = ()) -> int:
    parser = build_parser(plugins)
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    from lockgate.logformat import configure

    try:
        configure(level, str(args.log_format))
    except ValueError as exc:  # LOCKGATE_LOG_FORMAT is not checked by argparse's choices
        print(f"lockgate: error: {exc}", file=sys.stderr)
        return 2
    if level > logging.DEBUG:
        # websockets logs "connection open" / "connection closed" at INFO for every connection: an
        # edge holding 10,000 clients would print 20,000 lines per reconnect wave, formatted on its
        # event loop. The edge's metrics count connections; DEBUG brings the lines back.
        logging.getLogger("websockets").setLevel(logging.WARNING)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from bus import BusError

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
