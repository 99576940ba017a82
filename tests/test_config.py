"""The configuration registry (pathways/config.py): it lists every environment variable the
package reads, each read goes through it, and docs/configuration.md is its table."""

import ast
import re
from pathlib import Path

import pytest

from pathways import config, keeper
from pathways.defaults import ADDRESS_LINE

ROOT = Path(__file__).resolve().parent.parent
# ours start with PATHWAYS_; pathwaysutils' ENABLE_PATHWAYS_PERSISTENCE is not one of them
NAME = re.compile(r"(?<![A-Z_])PATHWAYS_[A-Z][A-Z_]*[A-Z]")
REGISTERED = {v.name for v in config.VARIABLES}


def _sources():
    for package in ("pathways", "pathways_bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto" not in path.relative_to(ROOT).parts:
                yield path


def test_docs_configuration_is_the_registrys_table():
    assert (ROOT / "docs" / "configuration.md").read_text() == config.table(), \
        "regenerate it: python -m pathways.config > docs/configuration.md"


def test_every_variable_named_in_the_code_and_the_docs_is_registered():
    texts = [*_sources(), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unknown = {f"{path.relative_to(ROOT)}: {name}" for path in texts for name in NAME.findall(path.read_text())
               if name not in REGISTERED and not ADDRESS_LINE.startswith(name)}
    assert not unknown, sorted(unknown)
    assert len(REGISTERED) == len(config.VARIABLES), "each variable is registered once"


def test_no_module_but_the_registry_and_the_keeper_spells_a_variables_name():
    spelled = []
    for path in _sources():
        if path.parent.name == "pathways" and path.name in ("config.py", "keeper.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in REGISTERED:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not spelled, f"read them through pathways.config instead: {spelled}"


def test_the_keeper_spells_the_variables_it_shares_with_the_worker_as_the_registry_does():
    # the keeper runs as a script of the standard library alone, so it keeps its own names
    assert (keeper.KEPT_ENV, keeper.RECONNECT_UNTIL_ENV, keeper.PARENT_PID_ENV, keeper.LOG_LEVEL_ENV) == \
        (config.WORKER_KEPT.name, config.RECONNECT_UNTIL.name, config.PARENT_PID.name, config.LOG_LEVEL.name)


def test_a_variable_reads_its_kind_or_its_default_and_a_bad_value_names_the_variable():
    assert config.LOG_LEVEL.get({}) == "warning" and config.LOG_LEVEL.get({"PATHWAYS_LOG_LEVEL": " INFO "}) == "info"
    assert config.ADDRESS.get({"PATHWAYS_ADDRESS": "  "}) is None, "blank counts as unset"
    assert config.PLAN_LOG.get({"PATHWAYS_PLAN_LOG": "1"}) is True
    assert config.PLAN_LOG.get({"PATHWAYS_PLAN_LOG": "off"}) is False and config.PLAN_LOG.get({}) is False
    assert config.SPMD_INIT_TIMEOUT.get({"PATHWAYS_SPMD_INIT_TIMEOUT": "7.5"}) == 7.5
    with pytest.raises(ValueError, match=r"PATHWAYS_LOG_LEVEL='loud': expected one of debug, info"):
        config.LOG_LEVEL.get({"PATHWAYS_LOG_LEVEL": "loud"})
    with pytest.raises(ValueError, match=r"PATHWAYS_SPMD_RANK='one': expected a whole number"):
        config.SPMD_RANK.get({"PATHWAYS_SPMD_RANK": "one"})
