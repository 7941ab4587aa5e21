"""Every Sphinx role in pipeflow's docstrings (``:func:``, ``:mod:``, ``:class:``,
``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``) names something that exists.

Resolved over the sources' syntax trees, nothing imported (no torch): a dotted
``pipeflow.a.b.c`` resolves when module ``pipeflow.a.b`` defines ``c`` at top level, in a
class (its bases followed) or imports it; ``~`` is dropped; a leading dot is relative to
the module's package (or, as Sphinx reads it, to the module and class the docstring is
in); an unqualified name is looked up in the docstring's class, then its module. Names
outside pipeflow (``torch.x``, ``Path``) are skipped: a builtin, a name the module imports
from outside pipeflow, or a top-level package other than pipeflow.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pipeflow"
ROLE = re.compile(r":(func|mod|class|meth|attr|data|exc|obj):`([^`]+)`")
EXTERNAL = "external"  # a resolution outside pipeflow, skipped


@dataclass
class Module:
    name: str
    package: str  # what a one-dot relative name starts from
    names: set[str] = field(default_factory=set)  # top-level functions and values
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)  # top-level classes
    imports: dict[str, str] = field(default_factory=dict)  # local name -> absolute dotted target
    tree: ast.Module | None = None


def _absolute(module: Module, level: int, base: str | None) -> str:
    if not level:
        return base or ""
    package = module.package.split(".")
    head = ".".join(package[: len(package) - (level - 1)])
    return f"{head}.{base}" if base else head


def _top_level(body: list[ast.stmt]):
    """The statements of a module's top level, through ``if`` and ``try`` blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", [])),
                          getattr(node, "finalbody", [])):
                yield from _top_level(block)


def _statements(node: ast.AST):
    """Every statement under ``node``, nested ones included (no expressions: imports and
    assignments are statements, and skipping the expressions keeps the walk fast)."""
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, name, ()):
            yield child
            yield from _statements(child)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def load_modules(root: Path = ROOT) -> dict[str, Module]:
    """pipeflow's modules by dotted name, their top-level names, classes and imports."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        module = Module(name, name if is_package else name.rpartition(".")[0])
        module.tree = ast.parse(path.read_text())
        for node in _top_level(module.tree.body):
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.names.add(node.name)
            elif isinstance(node, ast.Assign):
                module.names.update(n for t in node.targets for n in _targets(t))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                module.names.update(_targets(node.target))
        for node in _statements(module.tree):  # lazy imports too: a function's docstring may name them
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, node.level, node.module)
                for alias in node.names:
                    module.imports.setdefault(alias.asname or alias.name, f"{base}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    module.imports.setdefault(local, alias.name if alias.asname else local)
        out[name] = module
    return out


@functools.cache
def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes, fields and the ``self.x`` its methods assign."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, ast.AnnAssign):
            out.update(_targets(node.target))
    for node in _statements(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "__setattr__" \
                and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
            out.add(call.args[1].value)  # a frozen dataclass's object.__setattr__(self, "x", ...)
    return out


class Resolver:
    def __init__(self, modules: dict[str, Module]):
        self.modules = modules

    def dotted(self, name: str) -> bool | str:
        """An absolute dotted name: True, False, or EXTERNAL outside pipeflow."""
        parts = name.split(".")
        if parts[0] != "pipeflow":
            return EXTERNAL
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in self.modules:
                return self.in_module(head, parts[cut:])
        return False

    def in_module(self, module_name: str, parts: list[str], seen: frozenset = frozenset()) -> bool | str:
        if not parts:
            return True
        module = self.modules[module_name]
        head, rest = parts[0], parts[1:]
        if head in module.classes:
            return self.in_class(module, module.classes[head], rest, seen)
        if head in module.names:
            return not rest
        if f"{module_name}.{head}" in self.modules:
            return self.in_module(f"{module_name}.{head}", rest, seen)
        if head in module.imports:
            target = module.imports[head]
            if target in seen:
                return False
            return self.dotted(".".join([target, *rest]))
        return False

    def in_class(self, module: Module, cls: ast.ClassDef, parts: list[str], seen: frozenset = frozenset()) -> bool:
        if not parts:
            return True
        key = f"{module.name}.{cls.name}"
        if key in seen:
            return False
        if parts[0] in _members(cls):
            nested = next((n for n in cls.body if isinstance(n, ast.ClassDef) and n.name == parts[0]), None)
            return len(parts) == 1 or (nested is not None and self.in_class(module, nested, parts[1:], seen | {key}))
        for base in cls.bases:  # inherited members, from pipeflow's own bases
            found = self._base(module, ast.unparse(base).split("[")[0])
            if found and self.in_class(*found, parts, seen | {key}):
                return True
        return False

    def _base(self, module: Module, name: str):
        """The (module, class) a base-class expression names, when it is pipeflow's."""
        parts = name.split(".")
        if parts[0] in module.classes and len(parts) == 1:
            return module, module.classes[parts[0]]
        target = module.imports.get(parts[0])
        if target is None or not target.startswith("pipeflow"):
            return None
        full = ".".join([target, *parts[1:]]).split(".")
        for cut in range(len(full) - 1, 0, -1):
            owner = self.modules.get(".".join(full[:cut]))
            if owner is not None:
                if cut == len(full) - 1 and full[-1] in owner.classes:
                    return owner, owner.classes[full[-1]]
                if cut == len(full) - 1 and full[-1] in owner.imports:
                    return self._base(owner, full[-1])
                return None
        return None

    def reference(self, role: str, target: str, module: Module, cls: ast.ClassDef | None) -> bool | str:
        """Whether ``target`` (a role's text) resolves from a docstring of ``module`` (in ``cls``)."""
        target = target.strip()
        if "<" in target and target.endswith(">"):  # :func:`title <target>`
            target = target[target.index("<") + 1: -1]
        target = target.lstrip("~").removesuffix("()")
        if role == "mod":
            return self._module(target, module)
        if target.startswith("."):
            rest = target.lstrip(".")
            level = len(target) - len(rest)
            absolute = f"{_absolute(module, level, None)}.{rest}"
            if self.dotted(absolute) is True:
                return True
            target = rest  # Sphinx's reading: the current module's and class's names
        parts = target.split(".")
        if cls is not None and self.in_class(module, cls, parts) is True:
            return True
        found = self.in_module(module.name, parts)
        if found is not False:
            return found
        if parts[0] == "pipeflow":
            return self.dotted(target)
        if parts[0] in module.imports and not module.imports[parts[0]].startswith("pipeflow"):
            return EXTERNAL
        if hasattr(builtins, parts[0]) or (importlib.util.find_spec(parts[0]) is not None):
            return EXTERNAL
        return False

    def _module(self, target: str, module: Module) -> bool | str:
        if target.startswith("."):
            rest = target.lstrip(".")
            target = f"{_absolute(module, len(target) - len(rest), None)}.{rest}"
        if target.split(".")[0] != "pipeflow":
            return EXTERNAL if importlib.util.find_spec(target.split(".")[0]) is not None else False
        return target in self.modules


def docstrings(module: Module):
    """(docstring, class it is in or None, line) for the module, every class and function."""
    def visit(node: ast.AST, cls: ast.ClassDef | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield doc, child, child.lineno
                yield from visit(child, child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield doc, cls, child.lineno
                yield from visit(child, cls)

    doc = ast.get_docstring(module.tree, clean=False)
    if doc:
        yield doc, None, 1
    yield from visit(module.tree, None)


def broken_references(modules: dict[str, Module]) -> tuple[list[str], set[str]]:
    """('module:line :role:`target`' for every reference that resolves to nothing, the
    external names skipped)."""
    resolver = Resolver(modules)
    broken, skipped = [], set()
    for module in modules.values():
        for doc, cls, line in docstrings(module):
            for role, target in ROLE.findall(doc):
                found = resolver.reference(role, " ".join(target.split()), module, cls)
                if found is EXTERNAL:
                    skipped.add(target)
                elif not found:
                    broken.append(f"{module.name}:{line} :{role}:`{target}`")
    return broken, skipped


def test_every_docstring_reference_resolves():
    broken, _ = broken_references(load_modules())
    assert broken == []


def test_the_resolver_tells_a_real_name_from_a_stale_one(tmp_path):
    pkg = tmp_path / "pipeflow"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text(
        "from pathlib import Path\n"
        "class Base:\n    def inherited(self): ...\n"
        "class C(Base):\n    x: int = 0\n    def __init__(self):\n        self.y = 1\n"
        "    def m(self):\n        ':meth:`inherited` :attr:`y` :meth:`.m` :attr:`x`'\n"
        "def f():\n    ':func:`f` :class:`~pipeflow.sub.a.C` :meth:`C.m` :func:`.a.f` :class:`Path`'\n"
        "def g():\n    ':func:`pipeflow.sub.f` :mod:`pipeflow.sub.a` :class:`torch.Tensor` :func:`len`'\n"
        "def stale():\n    ':func:`.a.gone` :meth:`C.gone` :mod:`pipeflow.sub.b` :func:`nothing_here_xyz`'\n")
    broken, skipped = broken_references(load_modules(pkg))
    assert sorted(b.split(" ", 1)[1] for b in broken) == [
        ":func:`.a.gone`", ":func:`nothing_here_xyz`", ":meth:`C.gone`", ":mod:`pipeflow.sub.b`"]
    assert skipped == {"Path", "torch.Tensor", "len"}
