"""Turn the Kubernetes JSON schemas shipped in the ``kubernetes-validate`` wheel into kubeconform's
standalone layout, offline.

The wheel keeps one ``_definitions.json`` per Kubernetes version and refers to it as
``/api/_definitions.json#/$defs/...``, which kubeconform cannot resolve; each kind's schema is
written here with the definitions it reaches copied into its own ``$defs`` (refs rewritten to
``#/$defs/...``). Only top-level kinds (schemas with a ``kind`` property) are written.

    python scripts/deploy/k8s_schemas.py WHEEL VERSION OUT_DIR
writes ``OUT_DIR/v<VERSION>-standalone-strict/<kind>-<group>-<version>.json`` (and the non-strict set).
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from typing import Any

PREFIX = "kubernetes_validate/kubernetes-json-schema/"


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                found.add(v.split("#/$defs/", 1)[1])
            else:
                _refs(v, found)
    elif isinstance(node, list):
        for v in node:
            _refs(v, found)


def _local(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: ("#/$defs/" + v.split("#/$defs/", 1)[1]) if k == "$ref" and isinstance(v, str) else _local(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


def convert(wheel: Path, version: str, out: Path) -> int:
    written = 0
    with zipfile.ZipFile(wheel) as z:
        for strict in ("-strict", ""):
            src = f"{PREFIX}v{version}-local{strict}/"
            names = [n for n in z.namelist() if n.startswith(src) and n.endswith(".json")]
            if not names:
                raise SystemExit(f"{wheel.name} has no schemas for Kubernetes v{version} ({src})")
            defs = json.loads(z.read(src + "_definitions.json"))["$defs"]
            dest = out / f"v{version}-standalone{strict}"
            dest.mkdir(parents=True, exist_ok=True)
            for name in names:
                base = name.rsplit("/", 1)[1]
                if base.startswith("_") or base == "all.json":
                    continue
                schema = json.loads(z.read(name))
                if "kind" not in schema.get("properties", {}):
                    continue
                todo: set[str] = set()
                _refs(schema, todo)
                seen: set[str] = set()
                while todo:
                    d = todo.pop()
                    if d not in seen:
                        seen.add(d)
                        _refs(defs[d], todo)
                schema = _local(schema)
                schema["$defs"] = {d: _local(defs[d]) for d in sorted(seen)}
                (dest / base).write_text(json.dumps(schema))
                written += 1
    return written


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    n = convert(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
    print(f"{n} Kubernetes v{sys.argv[2]} schemas written to {sys.argv[3]}")
