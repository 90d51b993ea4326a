"""Schema evolution of the records (docs/bus.md, "Record evolution"): what a writer stamps on a
record and what a reader of another revision does with it, so old and new edges and workers can
share a topic during a rolling upgrade.

* ``"v"``: the writer's schema revision (:data:`SCHEMA_VERSION`). Revisions only add fields, each
  with a default meaning "as before"; removing, renaming or re-meaning a field is a new major
  layout on new topics, never on a shared one. A reader refuses ``v`` below :data:`MIN_SCHEMA_VERSION`.
* A reader of revision R and a record of revision ``v <= R``: strict. Missing fields take their
  defaults (an older writer did not know them); an unknown field is refused (a writer's bug: no
  revision up to R has it).
* ``v > R`` (a newer writer): the fields R knows are read and checked as ever; the others are
  ignored, at every depth, unless the record's ``"must"`` list names them: fields whose value
  changes the result (:func:`lockgate_types.evolution.must_understand`), which R refuses
  (``DecodeError``, so the record is dead-lettered) rather than serve without.

Pure; no I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from bus.codec import DecodeError
from lockgate_types.evolution import is_must_understand

# the revision this build writes and the newest it reads strictly. 2: InferenceRequest.lora
# (must-understand), WorkerStatus.loras, UsageRecord.lora (docs/bus.md, "Record evolution")
SCHEMA_VERSION = 2
MIN_SCHEMA_VERSION = 1  # older records are refused (a new major layout would raise this)

# per class: (field name, marked must-understand, nested dataclass type or None); only the fields
# that are marked or lead to a marked one, so a class without any costs one dict lookup to encode
_Plan = tuple[tuple[str, bool, "type | None"], ...]
_PLANS: dict[type, _Plan] = {}


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field of type ``tp`` holds (``X`` or ``X | None``), else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        _PLANS[cls] = ()  # a self-referencing class finds an empty plan while this one is built
        hints = typing.get_type_hints(cls)
        entries = []
        for f in dataclasses.fields(cls):
            nested = _dataclass_in(hints[f.name])
            if nested is not None and not _plan(nested):
                nested = None
            if is_must_understand(f) or nested is not None:
                entries.append((f.name, is_must_understand(f), nested))
        plan = _PLANS[cls] = tuple(entries)
    return plan


def _default(cls: type, name: str) -> Any:
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def must_list(msg: Any) -> list[str]:
    """The dotted paths of ``msg``'s must-understand fields that are set (not their default): what
    the writer names in the record's ``"must"``. Empty for every record of revision 1."""
    out: list[str] = []
    _collect(msg, "", out)
    return out


def _collect(obj: Any, prefix: str, out: list[str]) -> None:
    for name, must, nested in _plan(type(obj)):
        value = getattr(obj, name)
        if must and value != _default(type(obj), name):
            out.append(prefix + name)
        if nested is not None and value is not None:
            _collect(value, prefix + name + ".", out)


def knows(cls: type, path: str) -> bool:
    """Whether this build's ``cls`` has the (dotted) field ``path``."""
    for i, part in enumerate(path.split(".")):
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            return False
        if i < path.count("."):
            nested = _dataclass_in(typing.get_type_hints(cls)[part])
            if nested is None:
                return False
            cls = nested
    return True


def check_version(version: Any) -> None:
    """Refuse a record whose ``v`` this build cannot read (:class:`DecodeError`)."""
    if version.__class__ is not int or version < MIN_SCHEMA_VERSION:
        raise DecodeError(f"unsupported schema version {version!r} (this build reads {MIN_SCHEMA_VERSION} and later)")


def lenient_body(version: int, must: Any, cls: type, kind: str) -> bool:
    """Check a ``cls`` record's ``must`` list; returns whether its body is read leniently (a newer
    writer's: unknown fields skipped). Raises :class:`DecodeError` naming a must-understand field
    this build does not know."""
    if must is not None:
        if not isinstance(must, list) or not all(isinstance(p, str) and p for p in must):
            raise DecodeError(f"invalid {kind}: must: expected a list of field names")
        unknown = [p for p in must if not knows(cls, p)]
        if unknown:
            raise DecodeError(f"{kind} of schema revision {version} needs field(s) {unknown} that this build "
                              f"(revision {SCHEMA_VERSION}) does not know; upgrade this reader")
    return version > SCHEMA_VERSION
