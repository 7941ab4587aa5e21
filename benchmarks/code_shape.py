"""The code's shape, in the figures issue 77's acceptance names:

    python -m benchmarks.code_shape            # the summary
    python -m benchmarks.code_shape --list     # and every long module, function and silent test

- modules over 600 lines (the simulator's event-loop module may reach 800);
- functions over 80 lines, but the event loops;
- the share of the code's lines that are docstrings;
- ``AnalyticCost``'s public methods across the pipeflow classes it is made of;
- tests that assert nothing: a test asserts when it, or a function of the tests it calls
  by name, holds an ``assert``, a ``pytest.raises``/``warns``/``fail`` or a call named
  ``assert_*`` (torch.testing's, numpy's).
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONGEST_MODULE, EVENT_LOOP_MODULE, LONGEST_FUNCTION = 600, 800, 80
EVENT_LOOPS = ("pipeflow.sim.engine._events", "pipeflow.sim.engine._events_shared")


def modules() -> dict[str, Path]:
    """pipeflow's modules by dotted name."""
    out = {}
    for path in sorted((ROOT / "pipeflow").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def long_modules() -> dict[str, int]:
    """Modules over their limit -> lines."""
    out = {}
    for name, path in modules().items():
        n = len(path.read_text().splitlines())
        limit = EVENT_LOOP_MODULE if name == "pipeflow.sim.engine" else LONGEST_MODULE
        if n > limit:
            out[name] = n
    return out


def function_lengths() -> dict[str, int]:
    """Every function (module.Class.name) -> its lines; a nested one counts in its host."""
    out: dict[str, int] = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    for name, path in modules().items():
        visit(ast.parse(path.read_text()), name + ".")
    return out


def long_functions() -> dict[str, int]:
    return {k: n for k, n in function_lengths().items() if n > LONGEST_FUNCTION and k not in EVENT_LOOPS}


def docstring_share() -> tuple[int, int]:
    """(docstring lines, all lines) over pipeflow's modules."""
    doc = total = 0
    for path in modules().values():
        text = path.read_text()
        total += len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    doc += body[0].end_lineno - body[0].lineno + 1
    return doc, total


def analytic_cost_methods() -> dict[str, int]:
    """pipeflow class -> the public methods it defines (no leading underscore), over
    AnalyticCost's bases: the surface a reader of a stage's cost meets."""
    sys.path.insert(0, str(ROOT))
    from pipeflow.planning.cost import AnalyticCost

    out = {}
    for cls in inspect.getmro(AnalyticCost):
        if cls.__module__.startswith("pipeflow"):
            out[cls.__qualname__] = sum(1 for k, v in vars(cls).items()
                                        if inspect.isfunction(v) and not k.startswith("_"))
    return out


def _asserting(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("raises", "warns", "fail", "deprecated_call") or name.startswith("assert"):
                return True
    return False


def _called_names(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def silent_tests() -> list[str]:
    """Tests (file:line name) that assert nothing, directly or through the tests' helpers."""
    funcs: dict[str, list[ast.AST]] = {}
    tests = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.setdefault(node.name, []).append(node)
                if node.name.startswith("test"):
                    tests.append((path.name, node))
    asserts = {name for name, nodes in funcs.items() if any(_asserting(n) for n in nodes)}
    while True:  # a helper that calls an asserting helper asserts
        more = {name for name, nodes in funcs.items() if name not in asserts
                and any(_called_names(n) & asserts for n in nodes)}
        if not more:
            break
        asserts |= more
    return [f"{file}:{node.lineno} {node.name}" for file, node in tests
            if not (_asserting(node) or _called_names(node) & asserts)]


def main(argv: list[str] | None = None) -> None:
    show = "--list" in (sys.argv[1:] if argv is None else argv)
    mods, funcs, silent = long_modules(), long_functions(), silent_tests()
    doc, total = docstring_share()
    methods = analytic_cost_methods()
    print(f"modules over {LONGEST_MODULE} lines: {len(mods)}")
    if show:
        print("\n".join(f"  {k} {n}" for k, n in sorted(mods.items(), key=lambda kv: -kv[1])))
    print(f"functions over {LONGEST_FUNCTION} lines (but the event loops): {len(funcs)}")
    if show:
        print("\n".join(f"  {k} {n}" for k, n in sorted(funcs.items(), key=lambda kv: -kv[1])))
    print(f"docstring lines: {doc} of {total} ({100 * doc / total:.1f}%)")
    print(f"AnalyticCost's public methods: {sum(methods.values())} over {len(methods)} classes "
          + ", ".join(f"{k} {n}" for k, n in methods.items()))
    print(f"tests asserting nothing: {len(silent)}")
    if show:
        print("\n".join(f"  {t}" for t in silent))


if __name__ == "__main__":
    main()
