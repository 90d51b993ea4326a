"""The Files and Batches API's objects and the batch input/output line formats. Pure: no I/O.

A file or batch object is stored as JSON in a bus table (:class:`bus.Table`) and shown to its
owner (the tenant of the key that made it) in OpenAI's shape (:meth:`FileObject.api`,
:meth:`BatchObject.api`). Input validation follows OpenAI's split: what makes the *file* unusable
(a line that is not a JSON object, a missing or repeated ``custom_id``, a ``method`` other than
POST, a ``url`` other than the batch's endpoint, a ``body`` that is not an object) fails the whole
batch at validation with ``errors``; what only the endpoint can judge (the body's fields) is left
to the endpoint, whose refusal becomes that line's record in the error file.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from bus import BlobRef

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}  # OpenAI's only completion window
PURPOSES = ("batch", "batch_output")  # what may be uploaded: batch; batch_output is written by batches
UPLOAD_PURPOSES = ("batch",)
MAX_CUSTOM_ID = 512
MAX_LINES = 50_000  # OpenAI's limit of requests per batch
MAX_ERRORS = 100  # validation errors listed on a failed batch (the first ones)
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    tenant: str
    size: int
    created_at: int
    filename: str
    purpose: str
    blob: BlobRef

    def api(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.size, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}

    def dumps(self) -> bytes:
        return json.dumps({"id": self.id, "tenant": self.tenant, "bytes": self.size, "created_at": self.created_at,
                           "filename": self.filename, "purpose": self.purpose, "blob": self.blob.to_json()}).encode()

    @classmethod
    def loads(cls, data: bytes) -> FileObject:
        d = json.loads(data)
        return cls(d["id"], d["tenant"], d["bytes"], d["created_at"], d["filename"], d["purpose"],
                   BlobRef.from_json(d["blob"]))


@dataclass(frozen=True, slots=True)
class Counts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class BatchObject:
    """A batch's state. ``key_hash``: the key that made it; its lines run with that key's limits
    and fair-share weight, at tier 2."""

    id: str
    tenant: str
    key_hash: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    counts: Counts = field(default_factory=Counts)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[dict[str, Any], ...] | None = None
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, ...

    def moved(self, status: str, now: int, **changes: Any) -> BatchObject:
        """This batch in ``status`` from ``now`` on (``<status>_at`` set)."""
        return replace(self, status=status, times={**self.times, f"{status}_at": now}, **changes)

    def api(self) -> dict[str, Any]:
        t = self.times
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors":
                None if self.errors is None else {"object": "list", "data": list(self.errors)},
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "in_progress_at": t.get("in_progress_at"),
                "expires_at": self.expires_at, "finalizing_at": t.get("finalizing_at"),
                "completed_at": t.get("completed_at"), "failed_at": t.get("failed_at"),
                "expired_at": t.get("expired_at"), "cancelling_at": t.get("cancelling_at"),
                "cancelled_at": t.get("cancelled_at"),
                "request_counts": {"total": self.counts.total, "completed": self.counts.completed,
                                   "failed": self.counts.failed},
                "metadata": self.metadata}

    def dumps(self) -> bytes:
        return json.dumps({"id": self.id, "tenant": self.tenant, "key_hash": self.key_hash, "endpoint": self.endpoint,
                           "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                           "created_at": self.created_at, "expires_at": self.expires_at, "status": self.status,
                           "metadata": self.metadata, "counts": [self.counts.total, self.counts.completed,
                                                                  self.counts.failed],
                           "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                           "errors": None if self.errors is None else list(self.errors), "times": self.times}).encode()

    @classmethod
    def loads(cls, data: bytes) -> BatchObject:
        d = json.loads(data)
        return cls(d["id"], d["tenant"], d["key_hash"], d["endpoint"], d["input_file_id"], d["completion_window"],
                   d["created_at"], d["expires_at"], d["status"], d["metadata"], Counts(*d["counts"]),
                   d["output_file_id"], d["error_file_id"], None if d["errors"] is None else tuple(d["errors"]),
                   dict(d["times"]))


# --- input -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a valid input file. ``line``: 1-based line number in the file."""

    line: int
    custom_id: str
    body: dict[str, Any]


def validation_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(data: bytes, endpoint: str) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """The requests of a batch input file, or the validation errors that fail the batch (at most
    ``MAX_ERRORS``; the lines are then meaningless). Blank lines are skipped."""
    lines: list[InputLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [validation_error("invalid_file_format", f"the file is not UTF-8 text: {exc}")]
    for n, raw in enumerate(text.split("\n"), start=1):
        if len(errors) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        problem = _check_line(raw, n, endpoint, seen)
        if isinstance(problem, dict):
            errors.append(problem)
        else:
            lines.append(problem)
    if not errors and not lines:
        errors.append(validation_error("empty_file", "the input file holds no requests"))
    if not errors and len(lines) > MAX_LINES:
        errors.append(validation_error("too_many_requests", f"the file holds {len(lines)} requests, at most "
                                       f"{MAX_LINES} fit in one batch"))
    return (lines, []) if not errors else ([], errors)


def _check_line(raw: str, n: int, endpoint: str, seen: set[str]) -> InputLine | dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        return validation_error("invalid_json_line", f"line {n} is not valid JSON: {exc}", n)
    if not isinstance(obj, dict):
        return validation_error("invalid_json_line", f"line {n} is not a JSON object", n)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return validation_error("missing_required_parameter", f"line {n}: custom_id must be a non-empty string of "
                                f"at most {MAX_CUSTOM_ID} characters", n, "custom_id")
    if cid in seen:
        return validation_error("duplicate_custom_id", f"line {n}: the custom_id {cid[:100]!r} is used by an "
                                "earlier line; each request needs its own", n, "custom_id")
    seen.add(cid)
    if obj.get("method") != "POST":
        return validation_error("invalid_method", f"line {n}: method must be POST", n, "method")
    if obj.get("url") != endpoint:
        return validation_error("invalid_url", f"line {n}: url {str(obj.get('url'))[:100]!r} differs from the "
                                f"batch's endpoint {endpoint!r}", n, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return validation_error("invalid_request", f"line {n}: body must be a JSON object", n, "body")
    return InputLine(n, cid, body)


# --- output ----------------------------------------------------------------------------------------

def answered_record(batch_id: str, line: InputLine, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """What the endpoint answered for ``line`` (200: the output file; else the error file)."""
    return {"id": f"batch_req_{batch_id[6:]}_{line.line}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def unrun_record(batch_id: str, line: InputLine, code: str, message: str) -> dict[str, Any]:
    """A line the batch never ran (it was cancelled or expired first): the error file."""
    return {"id": f"batch_req_{batch_id[6:]}_{line.line}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for r in records)
