"""One-process micro-benchmarks of a kernel, a layer or a code path, each run as a module from a
source checkout (``.venv/bin/python -m benchmarks.micro.<name> --help``): the figures they printed
are in docs/benchmarks*.md and docs/observability.md with their commands. Unlike ``lockgate bench``'s
subcommands they measure one mechanism in isolation (often A/B inside one process)."""
