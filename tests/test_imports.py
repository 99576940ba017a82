"""The package's import structure: what a client loads, and that no modules import each other."""

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pathways

PACKAGE_DIR = Path(pathways.__file__).parent
SERVER_SIDE = ("pathways.controller", "pathways.worker", "pathways.planner")


def test_client_import_loads_no_controller_worker_or_planner() -> None:
    code = ("import sys, pathways; [getattr(pathways, name) for name in pathways.__all__]; "
            f"print('\\n'.join(m for m in sys.modules if m.split('.')[:2] in "
            f"{[p.split('.') for p in SERVER_SIDE]!r}))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert not loaded, f"`import pathways` loaded server-side modules: {loaded}"


def test_the_controller_a_worker_before_its_welcome_and_the_command_line_import_no_jax() -> None:
    # Importing JAX costs about a second of CPU: a cluster's processes that never use it
    # (the controller, a worker's host process that becomes its keeper, `pathways status`)
    # must not pay it; a worker imports it beside attaching (worker/server.py).
    code = ("import sys, pathways, pathways.__main__, pathways.controller.server, pathways.worker.server, "
            "pathways.cluster; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported JAX: {out.stdout}"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _walk_runtime(stmt)
            continue
        yield child
        yield from _walk_runtime(child)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_exports(tree: ast.Module) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """A module's ``_EXPORTS`` (module -> names) and ``_ALIASES`` (name -> name) literals,
    empty where it has none."""
    found: dict[str, Any] = {"_EXPORTS": {}, "_ALIASES": {}}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in found and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    return found["_EXPORTS"], found["_ALIASES"]


class ImportGraph:
    """Which pathways modules each pathways module imports, at top level or inside functions.

    Rules, so that an edge is a real dependency between modules:

    - ``import pathways.a.b`` is an edge to ``pathways.a.b``; ``from pathways.a import b`` is an
      edge to module ``pathways.a.b`` when there is one, else to ``pathways.a`` (``b`` is a name
      defined or re-exported there). Relative imports are resolved first.
    - Importing ``pathways.a.b`` also runs the ``__init__`` of ``pathways`` and ``pathways.a``;
      those implicit edges are not counted. A package's ``__init__`` is itself a module, and
      its re-exports (``from pathways.a.b import f`` in ``pathways/a/__init__.py``) are edges
      from the package to those submodules.
    - A module inside a package always runs after that package's ``__init__`` has started, so
      importing a name from one of its own ancestor packages depends only on where the name
      comes from: ``from pathways import f`` in ``pathways.x`` is resolved through the
      ancestor's ``from ... import f`` re-export to the module defining ``f`` (recursively),
      and ``import pathways as pw`` followed by ``pw.f`` likewise. A name the ancestor
      defines itself, or that cannot be traced, stays an edge to the ancestor.
    - A package whose names are imported when first used (``pathways/__init__.py``: its
      ``_EXPORTS`` literal maps each module to the names it gives, ``_ALIASES`` a name to
      another) re-exports them as if by ``from module import name``: edges from the package
      to those modules, and uses of the names resolved to them.
    - Imports under ``if TYPE_CHECKING:`` never run and are ignored.
    """

    def __init__(self) -> None:
        self.paths = _module_names()
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in self.paths.items()}
        self.edges: dict[str, set[str]] = {name: set() for name in self.paths}
        for name in self.paths:
            for target in self._imports(name):
                if target != name:
                    self.edges[name].add(target)

    def _is_package(self, name: str) -> bool:
        return self.paths[name].name == "__init__.py"

    def _is_ancestor(self, package: str, module: str) -> bool:
        return module.startswith(package + ".")

    def _origin(self, package: str, attr: str, seen: frozenset = frozenset()) -> Optional[str]:
        """The module that ``package``'s ``__init__`` takes ``attr`` from, followed through
        further package re-exports; None when the package defines it or it cannot be traced."""
        if f"{package}.{attr}" in self.paths:
            return f"{package}.{attr}"
        lazy, aliases = _lazy_exports(self.trees[package])
        attr = aliases.get(attr, attr)
        for source, names in lazy.items():
            if attr in names:
                if source not in self.paths or (source, attr) in seen:
                    return None
                if self._is_package(source):
                    return self._origin(source, attr, seen | {(source, attr)}) or source
                return source
        for node in self.trees[package].body:
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if (alias.asname or alias.name) != attr:
                    continue
                source = _absolute(package, True, node)
                if f"{source}.{alias.name}" in self.paths:
                    return f"{source}.{alias.name}"
                if source not in self.paths or (source, alias.name) in seen:
                    return None
                if self._is_package(source):
                    return self._origin(source, alias.name, seen | {(source, alias.name)}) or source
                return source
        return None

    def _through(self, module: str, package: str, attrs: list[str]) -> list[str]:
        """Edges for ``module`` using ``attrs`` of ``package``: resolved when ``package`` is an
        ancestor of ``module``, else the package itself (importing it runs its ``__init__``)."""
        if package not in self.paths:
            return []
        if not self._is_ancestor(package, module):
            return [f"{package}.{a}" if f"{package}.{a}" in self.paths else package for a in attrs] or [package]
        return [self._origin(package, a) or package for a in attrs] or [package]

    def _imports(self, module: str) -> Iterator[str]:
        tree = self.trees[module]
        yield from (source for source in _lazy_exports(tree)[0] if source in self.paths)
        for node in _walk_runtime(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not alias.name.startswith("pathways"):
                        continue
                    if alias.asname and self._is_ancestor(alias.name, module):
                        used = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                       and isinstance(n.value, ast.Name) and n.value.id == alias.asname})
                        yield from self._through(module, alias.name, used)
                    elif alias.name in self.paths:
                        yield alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, self._is_package(module), node)
                if source == "pathways" or source.startswith("pathways."):
                    yield from self._through(module, source, [a.name for a in node.names if a.name != "*"])

    def cycle(self) -> Optional[list[str]]:
        """One cycle of the graph as a path that returns to its start, or None."""
        state: dict[str, int] = {}  # 1 on the current path, 2 done
        path: list[str] = []

        def visit(name: str) -> Optional[list[str]]:
            state[name] = 1
            path.append(name)
            for target in sorted(self.edges[name]):
                if state.get(target) == 1:
                    return path[path.index(target):] + [target]
                if target not in state:
                    found = visit(target)
                    if found:
                        return found
            path.pop()
            state[name] = 2
            return None

        for name in sorted(self.edges):
            if name not in state:
                found = visit(name)
                if found:
                    return found
        return None


def test_import_graph_resolves_imports() -> None:
    """The rules of ImportGraph on modules whose imports are known, so that an acyclic result
    is not the result of missing edges."""
    graph = ImportGraph()
    # `from pathways.client import program` names a module.
    assert "pathways.client.program" in graph.edges["pathways.client.pipeline"]
    # A lazy import inside a function counts.
    assert "pathways.planner" in graph.edges["pathways.client.pipeline"]
    # A package's re-exports are edges to its submodules.
    assert {"pathways.client.api", "pathways.spmd", "pathways.errors"} <= graph.edges["pathways"]
    # `from pathways.spmd import launch` from outside the package depends on the package.
    assert "pathways.spmd" in graph.edges["pathways.__main__"]
    # `import pathways as pw` inside the package resolves `pw.pmap` to where pmap is defined.
    assert "pathways.client.compiled" in graph.edges["pathways.demo"]
    assert "pathways" not in graph.edges["pathways.demo"]


def test_type_checking_imports_are_skipped() -> None:
    tree = ast.parse("if TYPE_CHECKING:\n    import pathways.a\nelse:\n    import pathways.b\n"
                     "def f():\n    import pathways.c\n")
    imported = [a.name for n in _walk_runtime(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported == ["pathways.b", "pathways.c"]


def test_cycle_is_found_and_printed_as_a_path() -> None:
    graph = ImportGraph()
    graph.edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert graph.cycle() == ["a", "b", "c", "a"]
    graph.edges["c"] = set()
    assert graph.cycle() is None


def test_import_graph_has_no_cycle() -> None:
    cycle = ImportGraph().cycle()
    assert cycle is None, "pathways modules import each other: " + " -> ".join(cycle)
