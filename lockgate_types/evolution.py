"""The one marker a record's field carries about schema evolution (docs/bus.md, "Record evolution").

A field added to a record (or to ``SamplingParams``) after the first revision has a default that
means "as before", so a record without it reads as it always did. Most new fields can also be
ignored by an older reader without changing the result (a hint, a figure for logs). A field whose
non-default value changes what a worker must produce (an adapter, say) is marked
:func:`must_understand`: the writer then names it in the record's ``must`` list whenever it is set,
and a reader that does not know the field refuses the record instead of silently serving it
without. The marker lives here, beside ``SamplingParams``, so the leaf's fields can carry it too.
"""

from __future__ import annotations

from dataclasses import Field
from typing import Any

MUST_UNDERSTAND = "lockgate.must_understand"  # dataclass field metadata key


def must_understand() -> dict[str, Any]:
    """Field metadata: an older reader that does not know this field must refuse a record that sets
    it (``field(default=None, metadata=must_understand())``)."""
    return {MUST_UNDERSTAND: True}


def is_must_understand(f: Field) -> bool:
    return bool(f.metadata.get(MUST_UNDERSTAND, False))
