"""The apps' ``--help``, as plain text for a person at a terminal.

Hydra's own help page lists every config group it can see, the typed schemas under
``schema/`` too, and opens with "<app> is powered by Hydra". Every pipeflow app selects
``conf/hydra/help/pipeflow.yaml`` instead, which builds the page from two resolvers
registered here (by :func:`pipeflow.config.schema.register_configs`, which every app
calls before Hydra starts):

- ``${pipeflow_usage:NAME}``: the opening of the app module's docstring, its summary line
  and usage examples, as plain text (:func:`plain_text`);
- ``${pipeflow_groups:}``: each config group with its options, the ``schema/`` and
  ``hydra/`` groups left out.

:func:`plain_text` is also what pipeflow-compare's ``--help`` goes through.
"""

from __future__ import annotations

import ast
import importlib.util
import re

__all__ = ["plain_text", "usage", "config_groups", "register_help", "HIDDEN_GROUPS"]

HIDDEN_GROUPS = ("hydra", "schema")  # Hydra's own groups, and the schemas the option files build on

# :role:`text`, :role:`~a.b` and :role:`text <target>` (Sphinx cross-references)
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]+?)(?:\s*<[^`>]*>)?`")
_LITERAL = re.compile(r"``([^`]+)``")


def _role(match: re.Match) -> str:
    tilde, text = match.groups()
    return text.rsplit(".", 1)[-1] if tilde else text  # ~ shows the last component only, as Sphinx does


def plain_text(text: str) -> str:
    """reST markup read as plain text: ``:mod:`pipeflow.sim``` -> ``pipeflow.sim``,
    double-backtick literals -> the literal itself."""
    return _LITERAL.sub(r"\1", _ROLE.sub(_role, text))


def usage(app: str) -> str:
    """The opening of ``pipeflow.<app>``'s docstring: its first paragraph and the indented
    examples right after it, as plain text (the module is read, not imported)."""
    spec = importlib.util.find_spec(f"pipeflow.{app}")
    doc = None
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    if not doc:
        return f"pipeflow-{app}"
    paragraphs = re.split(r"\n\s*\n", doc.strip())
    kept = [paragraphs[0]]
    for paragraph in paragraphs[1:]:
        if not paragraph.startswith((" ", "\t")):  # the first prose paragraph: what follows is for developers
            break
        kept.append(paragraph)
    return plain_text("\n\n".join(kept))


def config_groups() -> str:
    """``group: option, option`` per config group Hydra can see, as its help lists them,
    without :data:`HIDDEN_GROUPS`."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    lines: list[str] = []

    def walk(parent: str) -> None:
        for child in loader.list_groups(parent):
            group = f"{parent}/{child}" if parent else child
            if group.split("/")[0] in HIDDEN_GROUPS:
                continue
            options = loader.get_group_options(group, ObjectType.CONFIG)
            if options:
                lines.append(f"{group}: {', '.join(sorted(options))}")
            walk(group)

    walk("")
    return "\n".join(sorted(lines))


def register_help() -> None:
    """Register the help page's resolvers with OmegaConf (idempotent). A ``$`` is doubled:
    Hydra fills the page as a ``string.Template``."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("pipeflow_usage", lambda app: usage(str(app)).replace("$", "$$"), replace=True)
    OmegaConf.register_new_resolver("pipeflow_groups", lambda: config_groups().replace("$", "$$"), replace=True)
