"""The memory contract (pipeflow.sim.memory_terms) and its glossary (docs/memory_terms.md)
agree, and a cost model that breaks the contract fails loudly, never priced at zero."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeflow.planning.branched_cost import BranchedAnalyticCost
from pipeflow.planning.cost import COARSE_ABSENT, AnalyticCost, CostModel
from pipeflow.formats.memory_categories import APART, CATEGORIES, MEANINGS, MEASURED, STATE
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.sim.memory_terms import COMPOSED, REQUIRED, TERMS, MissingTerm, Term, missing_terms, price, term_value

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "memory_terms.md"
TAGS = set(MEASURED)  # the runtime's tags (pipeflow.runtime.memory_replay)


def _tables() -> tuple[dict, dict]:
    """The glossary's two tables: term -> its cells, composition -> its description."""
    terms, composed = {}, {}
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([a-z_]+)`", cells[0]) if line.startswith("| `") else None
        if name is None:
            continue
        (terms if len(cells) == 7 else composed)[name.group(1)] = cells
    return terms, composed


def _priced_by(cls, name: str) -> str:
    if name in cls.absent_terms:
        return "absent"
    if not hasattr(cls, name):
        return "falls back"
    owner = next(k for k in cls.__mro__ if name in k.__dict__)
    return f"`{owner.__module__.removeprefix('pipeflow.')}`"


def test_the_glossary_lists_every_term_as_the_code_defines_it():
    terms, composed = _tables()
    assert sorted(terms) == sorted(TERMS) and sorted(composed) == sorted(COMPOSED)
    for name, (_, category, tag, analytic, branched, fallback, _lifetime) in terms.items():
        term = TERMS[name]
        assert category == term.category and set(category.split(", ")) <= set(CATEGORIES), name
        assert tag == (term.tag or term.category) and set(tag.split(", ")) <= TAGS, name
        assert fallback == (f"`{term.fallback}`" if term.fallback else ""), name
        assert term.fallback is None or term.fallback in TERMS, name
        # the module that prices it, for the analytic cost models
        assert analytic == _priced_by(AnalyticCost, name), name
        assert branched == _priced_by(BranchedAnalyticCost, name), name


def test_a_cost_model_that_neither_prices_nor_declares_a_term_is_refused_where_it_is_defined():
    with pytest.raises(MissingTerm, match="output_bytes \\(neither priced nor in absent_terms\\)"):
        class Renamed(UnitCost):  # noqa: F841 - a term its coarse declaration no longer covers
            absent_terms = COARSE_ABSENT - {"output_bytes"}
    with pytest.raises(MissingTerm, match="activation_bytes \\(priced and also in absent_terms\\)"):
        class Both(UnitCost):  # noqa: F841
            absent_terms = COARSE_ABSENT | {"activation_bytes"}
    # every cost model the package defines keeps the contract (else importing it failed)
    subclasses, todo = [], [CostModel]
    while todo:
        found = todo.pop().__subclasses__()
        subclasses += found
        todo += found
    assert {AnalyticCost, BranchedAnalyticCost, UnitCost} <= set(subclasses)
    assert all(missing_terms(c) == [] for c in subclasses
               if c.__module__.startswith("pipeflow.") and not getattr(c, "__abstractmethods__", None))


def test_the_walk_refuses_an_undeclared_term_and_prices_a_declared_one_at_zero():
    class Duck:  # not a CostModel: checked where the walk asks
        absent_terms = REQUIRED - {"activation_bytes"}

        def activation_bytes(self, stage, segment):
            return 3.0

    assert price(Duck(), "activation_bytes", 0, 0) == 3.0 and price(Duck(), "output_bytes", 0, 0) == 0.0
    with pytest.raises(MissingTerm, match="prices no 'output_bytes'"):
        price(type("Bare", (), {})(), "output_bytes", 0, 0)
    # a refinement falls back; a key the walk made up is refused
    assert term_value(("fresh_workspace_bytes", 0, 0), Duck()) == 0.0
    with pytest.raises(MissingTerm, match="neither a memory term nor one of the walk's compositions"):
        term_value(("activations_bytes", 0, 0), Duck())


def test_every_composition_is_composed_by_a_rule_of_its_own():
    """term_value composes each of COMPOSED by one rule (COMPOSE, or the weight versions,
    which read the engine's per-device counts): no composition is left to a fallback."""
    from pipeflow.sim.memory_terms import COMPOSE

    assert set(COMPOSE) | {"extra_versions"} == set(COMPOSED)


def test_the_simulator_and_the_runtime_count_in_one_list_of_categories():
    """One list (pipeflow.formats.memory_categories): the tape's categories, the runtime's
    (those plus the tags it measures apart), the pairs compared; a term naming no
    category, or a cost model whose state_bytes lacks one, is refused."""
    import ast

    from pipeflow.runtime import memory_replay
    from pipeflow.sim import memory_tape
    from pipeflow.sim.device_memory import COMPARED

    assert memory_tape.CATEGORIES is CATEGORIES and tuple(MEANINGS) == CATEGORIES and set(STATE) <= set(CATEGORIES)
    assert memory_replay.CATEGORIES is MEASURED and set(MEASURED) == set(CATEGORIES) | set(APART)
    assert list(COMPARED) == list(CATEGORIES) and COMPARED["activations"] == (("activations", "kv"), ("activations",))
    assert sorted(t for measured, _ in COMPARED.values() for t in measured) == sorted(MEASURED)
    # the replay ranks every tag (temporaries: untagged), and the runtime tags only measured categories
    assert set(memory_replay._PRIORITY) == set(MEASURED) - {"temporaries"}
    tagged = set()
    for path in (ROOT / "pipeflow" / "runtime").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tag" and len(node.args) == 2:
                arg = node.args[1]
            elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_tag"]:
                arg = node.value
            else:
                continue
            if isinstance(arg, ast.Constant):
                tagged.add(arg.value)
    assert {"weight_versions", "optimizer_state", "residuals", "kv", "inputs"} <= tagged <= set(MEASURED)
    with pytest.raises(ValueError, match="buffers is no memory category"):
        Term("buffer_bytes", "buffers", "a stage's buffers")
    with pytest.raises(MissingTerm, match="state_bytes prices no 'casts'"):
        term_value(("state", 0, "casts"), type("NoCasts", (), {"state_bytes": lambda self, s: {"parameters": 1.0}})())
