"""Checks of one JSON field, shared by every request parser of the edge (OpenAI, Anthropic, the
WebSocket protocol, guided decoding): each names the field and what it got, in JSON's words, so a
client learns exactly what was wrong whichever API it used."""

from __future__ import annotations

import math

from edge.request import ProtocolError

_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number", type(None): "null"}


def type_name(v: object) -> str:
    """``v``'s JSON type (``object``, ``array``, ...), or its Python type's name."""
    return _JSON_NAMES.get(type(v), type(v).__name__)


def int_field(obj: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """``obj[name]``: absent or null gives None; else an integer (not a boolean) within [lo, hi]."""
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{name} must be an integer, got {type_name(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ProtocolError(f"{name} must be {rng}, got {v}", name)
    return v


def num_field(obj: dict, name: str) -> float | None:
    """``obj[name]``: absent or null gives None; else a finite number (not a boolean)."""
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"{name} must be a finite number, got {type_name(v)}", name)
    return float(v)


def bool_field(obj: dict, name: str) -> bool:
    """``obj[name]``: absent or null gives False; else a boolean."""
    v = obj.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ProtocolError(f"{name} must be a boolean, got {type_name(v)}", name)
    return v
