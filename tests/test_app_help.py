"""The apps' --help reads as plain text for a user: it lists the config groups a user
chooses from (not the typed schemas under schema/) and carries no reST markup (double
backticks, :mod:`...` roles). The Hydra apps share conf/hydra/help/pipeflow.yaml;
pipeflow-compare prints its own docstring."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeflow.compare.cli import main as compare_main
from pipeflow.config import CONF_DIR, register_configs
from pipeflow.config.apphelp import config_groups, plain_text, usage

MARKUP = re.compile(r"``|:(?:mod|class|func|meth|attr|data|ref):`")
APPS = ("train", "simulate", "plan", "search")


def test_plain_text_drops_rest_markup():
    text = (":mod:`pipeflow.sim` runs ``key=value``; see :class:`~pipeflow.compare.cli.CompareConfig` "
            "and :func:`f <a.f>`")
    assert plain_text(text) == "pipeflow.sim runs key=value; see CompareConfig and f"


@pytest.mark.parametrize("app", APPS)
def test_usage_is_the_docstrings_summary_and_examples_without_markup(app):
    text = usage(app)
    assert text.startswith(f"pipeflow-{app}: ")
    assert f"\n    pipeflow-{app} " in text  # the indented examples come along
    assert "Composition only" not in text  # the developers' paragraphs do not
    assert not MARKUP.search(text)


def test_every_app_selects_the_one_help_page():
    page = (CONF_DIR / "hydra" / "help" / "pipeflow.yaml").read_text()
    assert "${pipeflow_groups:}" in page and "$APP_CONFIG_GROUPS" not in page
    for app in APPS:
        assert "override hydra/help: pipeflow" in (CONF_DIR / f"{app}.yaml").read_text(), app


def test_the_group_list_leaves_out_the_schemas():
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        lines = config_groups().splitlines()
    groups = {line.split(":")[0]: line for line in lines}
    assert not [g for g in groups if g.startswith(("schema", "hydra"))]
    assert "gpipe" in groups["schedule"] and "analytic" in groups["cost"] and "gpt_tiny" in groups["model"]


def test_compare_help_is_plain(capsys):
    assert compare_main(["--help"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("pipeflow-compare: ") and "usage: pipeflow-compare" in said
    assert not MARKUP.search(said)


@pytest.mark.slow  # four app processes
@pytest.mark.parametrize("app", APPS)
def test_help_of_each_app(app, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    proc = subprocess.run([sys.executable, "-m", f"pipeflow.{app}", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout
    assert said.startswith(f"pipeflow-{app}: ")
    assert "powered by Hydra" not in said
    groups = said.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert re.search(r"^schedule: .*\b1f1b\b", groups, re.M)
    assert re.search(r"^topology: .*\blocal_cpu\b", groups, re.M)
    assert not re.search(r"^schema", groups, re.M)
    assert not MARKUP.search(said)
    # the composed config still follows (the search's options are its own group of keys)
    assert ("search:" if app == "search" else "pipeline:") in said.split("== Config ==")[1]
    assert not list(Path(tmp_path).iterdir())  # --help runs nothing, writes nothing
