"""The package's layers hold: no import cycles, no module importing a higher layer, and
the torch-free layers import without torch.

Imports are read from the source (every ``import`` statement, at module level or inside
a function: a lazy import is still a dependency). Modules of one layer may import each
other, in one direction only (no cycles).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import code_shape

ROOT = Path(__file__).resolve().parents[1] / "pipeflow"

# lowest first; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, ...]] = [
    # checks, family specs (HF configs), the IR, the hardware; the records layers hand each
    # other (the run plan, the timeline and its trace)
    ("pipeflow.faults", "pipeflow.numbers", "pipeflow.families", "pipeflow.hf", "pipeflow.schedules", "pipeflow.topology",
     "pipeflow.formats", "pipeflow.device_paths"),  # (device_paths: which device's code paths run)
    ("pipeflow.sim",),  # the discrete-event simulator
    ("pipeflow.planning", "pipeflow.tracking"),  # costs, partitions, planner, coordinator; metrics and W&B
    ("pipeflow.data",),  # the loaders (torch and datasets; the config checks a user's files through them, lazily)
    ("pipeflow.config",),  # schemas, checks, preparation: config -> the run plan (torch-free)
    ("pipeflow.models",),  # torch from here on
    ("pipeflow.runtime",),  # the torch.distributed executor: instantiates a run plan, reads no config
    ("pipeflow.compare",),
    ("pipeflow.train", "pipeflow.simulate", "pipeflow.plan", "pipeflow.search", "pipeflow.calibrate", "pipeflow.profile",
     "pipeflow.measure_device", "pipeflow.fold_trace"),  # the apps
]
# Issue 31's four upward imports, named so that a regression reads as what it is
FORBIDDEN = [("pipeflow.runtime", "pipeflow.config"), ("pipeflow.runtime", "pipeflow.sim"),
             ("pipeflow.config", "pipeflow.runtime"), ("pipeflow.config", "pipeflow.models")]
TORCH_FREE = ["pipeflow.device_paths", "pipeflow.schedules.registry", "pipeflow.topology.presets", "pipeflow.sim", "pipeflow.planning.planner",
              "pipeflow.planning.coordinator", "pipeflow.config", "pipeflow.config.to_runplan", "pipeflow.tracking.sink",
              "pipeflow.formats", "pipeflow.formats.runplan", "pipeflow.formats.timeline"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The pipeflow modules ``name`` imports (a package's ``__init__`` counts as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
                break
    return found


def _layer(name: str) -> int:
    best, rank = "", None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    if rank is None:
        raise AssertionError(f"{name}: in no layer; add its package to LAYERS")
    return rank


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_module_imports_a_higher_layer():
    graph = _graph()
    upward = sorted(f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
                    for a, targets in graph.items() if a != "pipeflow"
                    for b in targets if not b.startswith(a + ".")  # a package's own modules
                    and _layer(b) > _layer(a))
    assert upward == []


def test_the_four_upward_imports_of_issue_31_stay_gone():
    """The runtime reads no config and no simulator (it instantiates the run plan and
    records into the formats' timeline); the config never reaches into the runtime (a
    checkpoint's metadata is read torch-free) nor the models (their shapes are planning's)."""
    graph = _graph()
    found = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                   for low, high in FORBIDDEN if a.startswith(low) and (b == high or b.startswith(high + ".")))
    assert found == []


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exports its own modules: those edges are the package itself
    edges = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a lazy import of the runtime from a schedule module is upward."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from ..runtime import worker\n")
    known = set(_modules())
    got = _imports("pipeflow.schedules.bad", path, known)
    assert got == {"pipeflow.runtime.worker"} and _layer("pipeflow.runtime.worker") > _layer("pipeflow.schedules.bad")


@pytest.mark.slow  # a subprocess or a large search
@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_layers_import_without_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# The limits and the lengths are benchmarks/code_shape.py's, which prints them: the event
# loop stays whole (one pass over the ready actions whose branches share its locals; two
# forms, one per compute model: merged, every simulation would pay for the shared host's
# scan), every other function at most LONGEST_FUNCTION lines, every module at most
# LONGEST_MODULE (the event loop's, EVENT_LOOP_MODULE).


def test_no_function_is_over_80_lines():
    """Functions split by what they do, each at most 80 lines; the event loop stays whole."""
    lengths = code_shape.function_lengths()
    assert code_shape.LONGEST_FUNCTION == 80
    assert all(name in lengths for name in code_shape.EVENT_LOOPS)
    assert code_shape.long_functions() == {}


def test_no_module_is_over_600_lines():
    """Modules split along their ideas, each at most 600 lines (the simulator's event
    loop's, pipeflow.sim.engine, at most 800)."""
    assert (code_shape.LONGEST_MODULE, code_shape.EVENT_LOOP_MODULE) == (600, 800)
    assert "pipeflow.sim.engine" in code_shape.modules()
    assert code_shape.long_modules() == {}


def test_no_two_modules_share_a_name():
    """A module's name says the one thing it holds, across packages too: a reader who
    meets ``device_memory`` or ``kernel_scratch`` in a traceback knows which file it is
    (three ``memory.py``, two ``calibrate.py`` and two ``checkpoint.py`` stood for
    different ideas before issue 61)."""
    names: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(str(path.relative_to(ROOT.parent)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
