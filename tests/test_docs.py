"""The README and docs/ stay short and current: the README within 200 lines, the
schedule tables equal to what the registered specs say, every relative link and anchor
pointing at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeflow.config.command_line import schedule_table

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", ["README.md", "docs/schedules.md"])
def test_schedule_tables_are_the_specs(page):
    text = (REPO / page).read_text()
    found = re.search(r"<!-- schedules -->\n(.*?)\n<!-- /schedules -->", text, re.S)
    assert found, f"{page}: no <!-- schedules --> table"
    assert found.group(1).strip() == schedule_table(), \
        f"{page}: regenerate the table with `python -m pipeflow.config schedules`"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert bad == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme] == []
