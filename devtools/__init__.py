"""Development and test tools, not product code (outside the wheel: pyproject.toml's package list
leaves them out; a source checkout's ``make install`` makes them importable): the tiny random Llama
(:mod:`.tiny_model`, also ``lockgate model tiny``), the fake worker (:mod:`.fake_worker`) and the
local Kafka launcher (:mod:`.kafka_local`, ``lockgate kafka``).

The tests, the benchmarks and the CLI's two dev commands import them (the CLI lazily, inside the
command); no product package does (the import-linter contracts in pyproject.toml)."""
