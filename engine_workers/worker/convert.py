"""Wire request -> engine vocabulary: the one place the worker translates between the bus's
message types and the engine's own."""

from __future__ import annotations

from dataclasses import fields

import bus
from engine_workers.engine.params import SamplingParams

_FIELDS = tuple(f.name for f in fields(SamplingParams))


def engine_params(wire: bus.SamplingParams) -> SamplingParams:
    """The engine's :class:`SamplingParams` for a request's (already validated) wire parameters.
    Every engine field has a wire field of the same name; a new engine field without one fails here
    at import of the first request, not silently."""
    return SamplingParams(**{name: getattr(wire, name) for name in _FIELDS})
