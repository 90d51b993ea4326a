"""The vocabulary the bus and the engine share: one definition each, validated once.

A leaf: it imports nothing of ours, and the import-linter contracts in ``pyproject.toml`` let only
the bus and the engine (with the worker, the CLI root and the benchmarks) import it; the edge and
the producers reach it through the bus's facade (``bus.SamplingParams``), the wire vocabulary.
The engine runs with no bus (``lockgate generate``, the benchmarks) and the bus knows no engine,
so the one ``SamplingParams`` lives here rather than in either.
"""

from lockgate_types.sampling import FinishReason, SamplingParams, check_float, check_int

__all__ = ["FinishReason", "SamplingParams", "check_float", "check_int"]
