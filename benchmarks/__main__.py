"""``python -m benchmarks [--log-level ...] bench NAME ...``: the ``lockgate`` CLI with the benchmarks
passed in explicitly, for a source checkout that is not installed (no entry point metadata: the
device check scripts run from ``PYTHONPATH=$PWD``). Installed, ``lockgate bench ...`` is the same."""

from __future__ import annotations

import sys

from benchmarks.cli import register
from lockgate.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], plugins=(register,)))
