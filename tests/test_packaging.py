"""What `pip install .` brings: the runtime, and every module the package imports outside the
features that name an extra.

README's first command installs the package without extras, and must work after it alone.
The planner's solver, plots, TLS certificates and the examples' libraries come with extras
(pyproject.toml): a module imports them only inside the function that needs them (or for
type checking), so that importing the module works without them, and the error of a missing
one says which extra to install.
"""

import ast
import importlib
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


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names imported when ``path`` is imported: outside functions and
    ``if TYPE_CHECKING:`` blocks."""
    names = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _extras(project: dict) -> dict[str, set[str]]:
    """Each extra's distributions, the extras it names (pathways[...]) included."""
    raw = project["optional-dependencies"]

    def of(extra: str) -> set[str]:
        found = set()
        for requirement in raw[extra]:
            inner = re.fullmatch(r"pathways\[(.*)\]", requirement)
            found |= set().union(*map(of, inner[1].split(","))) if inner else {_distribution(requirement)}
        return found

    return {extra: of(extra) for extra in raw}


def test_every_import_is_a_main_dependency_or_an_extras_imported_only_where_needed() -> None:
    project = _project()
    main = {_distribution(r) for r in project["dependencies"]}
    extra = set().union(*_extras(project).values()) - main
    provided = importlib.metadata.packages_distributions()
    missing, eager = [], []
    packages = [p for p in ROOT.glob("pathways*") if (p / "__init__.py").exists()]
    for path in sorted([*(f for p in packages for f in p.rglob("*.py")), *(ROOT / "examples").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        top = _top_level_imports(path)
        for name in sorted(_imported(path)):
            if name in sys.stdlib_module_names or name.startswith("pathways") or rel.startswith(OPTIONAL.get(name, "\0")):
                continue
            dists = {_distribution(d) for d in provided.get(name, [name])}
            if dists & main:
                continue
            if not dists & extra:
                missing.append(f"{rel} imports {name} ({', '.join(sorted(dists))})")
            elif name in top and not rel.startswith("examples/"):
                eager.append(f"{rel} imports {name} when it is imported")
    assert not missing, "in none of pyproject.toml's dependencies or extras:\n" + "\n".join(missing)
    assert not eager, "an extra's module imported at the top of a module of the package:\n" + "\n".join(eager)


def test_the_runtime_installs_without_plots_the_solver_tls_or_the_examples_libraries() -> None:
    main = {_distribution(r) for r in _project()["dependencies"]}
    assert not main & {"matplotlib", "ortools", "pandas", "optax", "cryptography"}, main


def test_an_example_that_needs_an_extra_says_which() -> None:
    extras = _extras(_project())
    provided = importlib.metadata.packages_distributions()
    for path in sorted((ROOT / "examples").glob("*.py")):
        needs = {e for e, dists in extras.items() if e not in ("bench", "test")
                 for name in _imported(path) if {_distribution(d) for d in provided.get(name, [name])} & dists}
        for e in needs:
            assert f'pip install ".[{e}]"' in path.read_text(), f"{path.name} needs the {e} extra and does not say so"


@pytest.mark.parametrize("module, call, extra", [
    ("pathways.plotting", "pyplot", "plots"),
    ("pathways.planner.sat", "cp_model", "planner"),
    ("pathways.wire.certs", "make_certificates", "tls"),
])
def test_a_missing_extra_is_named_by_the_error(module, call, extra, monkeypatch, tmp_path) -> None:
    for blocked in ("matplotlib", "ortools", "ortools.sat", "ortools.sat.python", "cryptography"):
        monkeypatch.setitem(sys.modules, blocked, None)  # an import of it raises ImportError
    function = getattr(importlib.import_module(module), call)
    with pytest.raises(Exception, match=re.escape(f'pip install "pathways[{extra}]"')):
        function(str(tmp_path)) if call == "make_certificates" else function()
