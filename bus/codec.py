"""Strict conversion of decoded JSON (dicts, lists, scalars) into typed frozen dataclasses.

Generic: it knows field types, not messages. Converters are compiled once per type (typing
introspection is slow); a record then costs one closure call per field. Paths for error messages
are built only when something is wrong. Wrong types and missing required fields raise
:class:`DecodeError` naming the path; so do unknown fields, unless the conversion is ``lenient``
(a record of a newer schema revision than this build's: docs/bus.md, "Record evolution"), which
skips them at every depth.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, Union


class DecodeError(ValueError):
    """Raised for bytes that are not a valid lockgate message; the text says why."""



Converter = typing.Callable[[Any, str], Any]
_CONVERTERS: dict[tuple[Any, bool], Converter] = {}


def build(cls: type, obj: Any, path: str, lenient: bool = False) -> Any:
    """``obj`` as an instance of dataclass ``cls``; errors name ``path`` and the field.
    ``lenient``: fields ``cls`` (or a nested dataclass) does not have are skipped, not refused."""
    return _converter(cls, lenient)(obj, path)


def _converter(tp: Any, lenient: bool) -> Converter:
    conv = _CONVERTERS.get((tp, lenient))
    if conv is None:
        conv = _CONVERTERS[(tp, lenient)] = _compile(tp, lenient)
    return conv


def _compile(tp: Any, lenient: bool) -> Converter:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        inner = _converter(next(a for a in args if a is not type(None)), lenient)

        def union(value: Any, path: str) -> Any:
            if value is None:
                if nullable:
                    return None
                raise DecodeError(f"{path}: must not be null")
            return inner(value, path)

        return union
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _converter(args[0], lenient)
            exact = args[0] if args[0] in (int, str) else None  # token ids, stop strings: check in bulk

            def var_tuple(value: Any, path: str) -> Any:
                if not isinstance(value, list):
                    raise DecodeError(f"{path}: expected a list, got {type(value).__name__}")
                if exact is not None and all(v.__class__ is exact for v in value):
                    return tuple(value)
                return tuple([item(v, f"{path}[{i}]") for i, v in enumerate(value)])

            return var_tuple
        items = [_converter(a, lenient) for a in args]

        def fixed_tuple(value: Any, path: str) -> Any:
            if not isinstance(value, list):
                raise DecodeError(f"{path}: expected a list, got {type(value).__name__}")
            if len(items) != len(value):
                raise DecodeError(f"{path}: expected {len(items)} items, got {len(value)}")
            return tuple([c(v, f"{path}[{i}]") for i, (c, v) in enumerate(zip(items, value))])

        return fixed_tuple
    if tp is Any:
        return lambda value, _path: value
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return _compile_dataclass(tp, lenient)
    if tp is float:
        def number(value: Any, path: str) -> float:
            if value.__class__ is float:
                return value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DecodeError(f"{path}: expected a number, got {type(value).__name__}")
            return float(value)

        return number
    if tp is int:
        def integer(value: Any, path: str) -> int:
            if value.__class__ is not int:
                raise DecodeError(f"{path}: expected an integer, got {type(value).__name__}")
            return value

        return integer
    if tp in (str, bool):
        def exact_type(value: Any, path: str) -> Any:
            if value.__class__ is not tp:
                raise DecodeError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
            return value

        return exact_type
    raise TypeError(f"unsupported field type {tp!r}")


def _compile_dataclass(cls: type, lenient: bool) -> Converter:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    known = frozenset(names)
    plan: list[tuple[str, Converter]] = []

    def build_one(obj: Any, path: str) -> Any:
        if obj.__class__ is not dict:
            raise DecodeError(f"{path}: expected an object, got {type(obj).__name__}")
        if not lenient and not known.issuperset(obj):
            raise DecodeError(f"{path}: unknown field(s) {sorted(set(obj) - known)}")
        kwargs = {name: conv(obj[name], path + "." + name) for name, conv in plan if name in obj}
        try:
            return cls(**kwargs)
        except TypeError as exc:  # missing required fields
            raise DecodeError(f"{path}: {exc}") from None

    _CONVERTERS[(cls, lenient)] = build_one  # registered before the plan is filled: a self-referencing field finds it
    plan.extend((name, _converter(hints[name], lenient)) for name in names)
    return build_one
