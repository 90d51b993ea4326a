"""The layer rules hold, and breaking one fails: the import-linter contracts in pyproject.toml run
over the real packages (kept), then over a copy of them with one forbidden import added (broken,
naming the contract). No import cycles between packages or between the modules of a package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bus", "edge", "producers", "engine_workers", "kv_store", "tokenization", "tracing", "lockgate", "lockgate_types",
            "benchmarks", "devtools")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(cwd / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_layer_contracts_are_kept() -> None:
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BROKEN" not in run.stdout and " KEPT" in run.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("edge/_probe.py", "import engine_workers.engine.core\n",
     "The edge and the producers import only the bus and the shared tokenization"),
    ("bus/_probe.py", "import kv_store\n", "bus imports nothing of ours"),
    ("engine_workers/engine/_probe.py", "import bus.messages\n", "The engine knows no bus and no worker"),
    ("kv_store/_probe.py", "import lockgate.cli\n", "Product packages never import the composition root or the benchmarks"),
    ("bus/_probe.py", "import bus.kafka\n", "No import cycles between the modules or subpackages of any package"),
    ("edge/ws/_probe.py", "import edge.openai.routes\n",
     "The edge's WebSocket, OpenAI and Anthropic front ends are independent"),
    ("edge/openai/_probe.py", "import edge.ws.session\n",
     "The edge's WebSocket, OpenAI and Anthropic front ends are independent"),
    ("edge/admission/_probe.py", "import edge.anthropic.routes\n", "Edge admission knows neither front end"),
    ("edge/admission/lifecycle.py", "import edge.admission.router\n", "Inside edge admission: gate > router > lifecycle"),
    ("edge/openai/stream.py", "import edge.admission.gate\n", "Edge reply sinks know the stream lifecycle, not admission"),
    ("edge/_probe.py", "from bus.messages import Tier\n", "Code outside bus/ imports the bus through its facade"),
    ("engine_workers/worker/_probe.py", "import bus.kafka.bus\n", "Code outside bus/ imports the bus through its facade"),
    ("engine_workers/worker/offsets/_probe.py", "import engine_workers.worker.pipeline.admission\n",
     "Inside the worker: actor > wiring > pipeline > the rooms below"),
    ("engine_workers/worker/pipeline/gate.py", "import engine_workers.worker.pipeline.resume\n",
     "The worker's pipeline stages import none of each other"),
    ("tracing/_probe.py", "import bus\n", "tracing imports nothing of ours"),
    ("bus/_probe.py", "import tracing\n", "bus imports nothing of ours"),
    ("lockgate_types/_probe.py", "import bus\n", "lockgate_types imports nothing of ours"),
    ("edge/_probe.py", "from lockgate_types import SamplingParams\n", "Only the bus and the engine import lockgate_types"),
    ("engine_workers/model/_probe.py", "import lockgate_types\n", "Only the bus and the engine import lockgate_types"),
    ("engine_workers/model/models/_probe.py", "import engine_workers.model.execution.runner\n",
     "Inside engine_workers.model: execution > lora > loading > models"),
    ("engine_workers/model/models/_probe.py", "import engine_workers.model.loading.loader\n",
     "Inside engine_workers.model: execution > lora > loading > models"),
    ("engine_workers/model/loading/_probe.py", "import engine_workers.model.execution.parallel.group\n",
     "Inside engine_workers.model: execution > lora > loading > models"),
    ("lockgate/_probe.py", "import benchmarks.cli\n", "The CLI never imports the benchmarks (they plug in through an entry point)"),
    ("benchmarks/_probe.py", "import lockgate.cli\n", "The benchmarks plug into the CLI, never import it"),
    ("edge/_probe.py", "import devtools.fake_worker\n", "Product code never imports the dev tools"),
    ("lockgate/_probe.py", "import devtools.kafka_local\n", "Product code never imports the dev tools"),
    ("devtools/_probe.py", "import lockgate.options\n", "The dev tools never import the CLI or the benchmarks"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "csrc", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / module).write_text(line)
    if module == "bus/_probe.py" and "kafka" in line:
        # close the loop: bus.kafka -> bus._probe -> bus.kafka
        kafka = tmp_path / "bus" / "kafka" / "bus.py"
        kafka.write_text(kafka.read_text() + "\nimport bus._probe  # noqa: E402\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = run.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, run.stdout


def _strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node: each one is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


def test_no_import_cycle_between_modules_or_packages() -> None:
    graph = grimp.build_graph(*PACKAGES)  # TYPE_CHECKING imports count too
    modules = sorted(graph.modules)
    by_module = {m: set(graph.find_modules_directly_imported_by(m)) for m in modules}
    assert _strongly_connected(modules, by_module) == []
    by_package: dict[str, set[str]] = defaultdict(set)
    for m, imported in by_module.items():
        by_package[m.split(".")[0]] |= {i.split(".")[0] for i in imported} - {m.split(".")[0]}
    assert _strongly_connected(list(PACKAGES), by_package) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _strongly_connected(["a", "b", "c"], {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected(["a", "b"], {"a": {"b"}}) == []
