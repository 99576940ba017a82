"""What `pip install .` brings: every module the package and the examples import.

README's first command installs the package without extras, and every command and example
README shows must work after it alone; a module only the test extra brings (optax was one)
fails the newcomer's second command with ModuleNotFoundError.
"""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import pathways

ROOT = Path(pathways.__file__).parent.parent
# Imported only by tools README tells to install first (`pip install grpcio-tools==...`), or
# only when the user's own script brought the package (pathwaysutils registers its backend).
OPTIONAL = {"grpc_tools": "pathways/ifrt/schema", "pathwaysutils": "pathways/ifrt"}


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path``, at any depth (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_main_dependencies_cover_every_import_of_the_package_and_examples() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    main = {_distribution(r) for r in project["dependencies"]}
    provided = importlib.metadata.packages_distributions()
    missing = []
    packages = [p for p in ROOT.glob("pathways*") if (p / "__init__.py").exists()]
    for path in sorted([*(f for p in packages for f in p.rglob("*.py")), *(ROOT / "examples").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for name in sorted(_imported(path)):
            if name in sys.stdlib_module_names or name.startswith("pathways") or rel.startswith(OPTIONAL.get(name, "\0")):
                continue
            dists = {_distribution(d) for d in provided.get(name, [name])}
            if not dists & main:
                missing.append(f"{rel} imports {name} ({', '.join(sorted(dists))})")
    assert not missing, "not in pyproject.toml's main dependencies:\n" + "\n".join(missing)
