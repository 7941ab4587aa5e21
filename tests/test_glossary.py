"""docs/glossary.md holds one word per idea: every code path it names resolves (over the
sources' syntax trees, as tests/test_docstrings.py resolves docstring references: no
torch), and the synonyms it retires appear in no other page's prose (backticks and code
blocks are code; ALLOWED holds the user-facing config names that keep the old words)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docstrings import Resolver, load_modules

REPO = Path(__file__).resolve().parents[1]
GLOSSARY = REPO / "docs" / "glossary.md"
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p != GLOSSARY)]
ALLOWED = ("model=cbm", "data=image_text")  # config names users type: they stay
CODE = re.compile(r"`([^`]+)`")


def rows() -> list[tuple[str, list[str], list[str]]]:
    """(word, code paths, retired synonyms) of each row of the glossary's table."""
    out = []
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("word", "---"):
            continue
        paths = [c for c in CODE.findall(cells[2]) if c.startswith("pipeflow.")]
        out.append((cells[0], paths, CODE.findall(cells[3])))
    return out


def prose(text: str) -> str:
    """A page's prose: code blocks, inline code, link targets and ALLOWED dropped."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"\]\([^)]*\)", "]", CODE.sub(" ", text))
    for name in ALLOWED:
        text = text.replace(name, " ")
    return text


def retired_uses(text: str, synonyms: list[str]) -> list[str]:
    """The retired synonyms the prose of ``text`` uses, as whole words, any case."""
    body = prose(text)
    return [s for s in synonyms if re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", body, re.I)]


def test_the_glossary_covers_the_ideas():
    words = {w for w, _, _ in rows()}
    for idea in ("run plan", "placement plan", "device", "rank", "stage", "segment", "microbatch", "window",
                 "chunk", "the concurrent-branch model", "device profile", "layer profile", "memory profile",
                 "calibration", "adapter", "memory terms"):
        assert idea in words, idea
    assert all(paths for _, paths, _ in rows()), "every row names where the code holds it"


def test_every_code_path_in_the_glossary_resolves():
    resolver = Resolver(load_modules())
    stale = [p for _, paths, _ in rows() for p in paths if resolver.dotted(p) is not True]
    assert stale == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_uses_a_retired_synonym(page):
    text = page.read_text()
    found = {word: uses for word, _, synonyms in rows() if (uses := retired_uses(text, synonyms))}
    assert found == {}, f"{page.name}: say the glossary's word instead"


def test_the_check_sees_prose_and_skips_code():
    """A retired word in prose is caught; in backticks, a code block or a config name it is not."""
    synonyms = ["branched model", "CBM"]
    assert retired_uses("Train the branched model.", synonyms) == ["branched model"]
    assert retired_uses("the cbm run", synonyms) == ["CBM"]
    assert retired_uses("`cbm` with model=cbm, cbm_tiny, chimera_cbm\n```\nCBM\n```\n", synonyms) == []
