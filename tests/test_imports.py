"""The package's import structure: what a client loads, what the lower layers load, which
layer may import which, and that no modules import each other."""

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

import pathways
import pathways_bench

PACKAGE_DIR = Path(pathways.__file__).parent
PACKAGES = (PACKAGE_DIR, Path(pathways_bench.__file__).parent)  # the runtime, and the benchmarks beside it
SERVER_SIDE = ("pathways.controller", "pathways.worker", "pathways.planner")

# The layers, lowest first: a module imports modules of its own layer and of those below it
# only. A module belongs to the layer of the longest name here that it is or is inside of
# ("pathways" is the package's __init__ alone); every module is named by one. Each role
# package (the planner, the controller, the workers, the local cluster, the client, the IFRT
# front end, the conductor) is a layer of its own, so that what each builds on is stated
# here, once; APART below keeps the controller and the workers off each other too.
LAYERS = (
    # and the IFRT proxy protocol's modules that protoc generated from pathways/ifrt/schema
    ("pathways.errors", "pathways.defaults", "pathways.config", "pathways.threads", "pathways.proto"),
    # Any process imports the two below, so they load neither JAX nor the client.
    # The bytes: codecs, frames, gRPC and TCP transports, security; they know no message.
    ("pathways.wire",),
    # The contracts: every message (control and data plane), its streams and bounds, the
    # program IR, timeline spans.
    ("pathways.protocol", "pathways.ir", "pathways.timeline"),
    # What several roles share: processes (keeper, template), platforms, HLO text, fusion
    # of programs, tables and plots.
    ("pathways.keeper", "pathways.template", "pathways.platforms", "pathways.hlo", "pathways.fusion",
     "pathways.table", "pathways.plotting", "pathways.timeline_view"),
    ("pathways.planner",),  # placement and partitioning, pure
    ("pathways.controller",),
    ("pathways.worker",),
    ("pathways.cluster",),  # starts controllers and workers as processes: imports neither
    ("pathways.spmd",),  # the multi-controller mode, on local processes
    ("pathways.client",),
    ("pathways.ifrt",),  # serves unmodified JAX through a native client session
    ("pathways.conductor",),  # distributes plain functions with the client
    ("pathways",),  # the public API (pw.jit, ...), on top of the client
    ("pathways.demo", "pathways_bench"),  # programs that use the public API
    ("pathways.cli", "pathways.__main__"),  # the command line runs all of them
)


def test_client_import_loads_no_controller_worker_or_planner() -> None:
    code = ("import sys; from pathways import *; "
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
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _ours(module: str) -> bool:
    return module.split(".")[0] in {p.name for p in PACKAGES}


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


class ImportGraph:
    """Which pathways modules each pathways module imports, at top level or inside functions.

    The modules are those of ``pathways`` and ``pathways_bench``. Rules, so that an edge is a
    real dependency between modules:

    - ``import pathways.a.b`` is an edge to ``pathways.a.b``; ``from pathways.a import b`` is an
      edge to module ``pathways.a.b`` when there is one, else to ``pathways.a`` (``b`` is a name
      defined or re-exported there). Relative imports are resolved first.
    - Importing ``pathways.a.b`` also runs the ``__init__`` of ``pathways`` and ``pathways.a``;
      those implicit edges are not counted. A package's ``__init__`` is itself a module, and
      its re-exports (``from pathways.a.b import f`` in ``pathways/a/__init__.py``, at top
      level or inside a function such as a lazy module ``__getattr__``) are edges from the
      package to those submodules.
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
        for node in _walk_runtime(self.trees[package]):  # at top level or in its lazy __getattr__
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
        for node in _walk_runtime(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not _ours(alias.name):
                        continue
                    if alias.asname and self._is_ancestor(alias.name, module):
                        used = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                       and isinstance(n.value, ast.Name) and n.value.id == alias.asname})
                        yield from self._through(module, alias.name, used)
                    elif alias.name in self.paths:
                        yield alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, self._is_package(module), node)
                if _ours(source):
                    yield from self._through(module, source, [a.name for a in node.names if a.name != "*"])


def find_cycle(edges: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of the graph ``edges`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(name: str) -> Optional[list[str]]:
        state[name] = 1
        path.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(edges):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


@functools.cache
def package_graph() -> ImportGraph:
    """The import graph of the repository's packages, built once (parsing every module takes
    seconds); read it, never change it."""
    return ImportGraph()


def test_import_graph_resolves_imports() -> None:
    """The rules of ImportGraph on modules whose imports are known, so that an acyclic result
    is not the result of missing edges."""
    graph = package_graph()
    # `from pathways.client import program` names a module.
    assert "pathways.client.program" in graph.edges["pathways.client.pipeline"]
    # A lazy import inside a function counts.
    assert "pathways.planner" in graph.edges["pathways.client.pipeline"]
    # A package's re-exports are edges to its submodules, those of its lazy __getattr__ too.
    assert {"pathways.client.api", "pathways.cluster", "pathways.errors"} <= graph.edges["pathways"]
    # `from pathways.spmd import launch` from outside the package depends on the package.
    assert "pathways.spmd" in graph.edges["pathways.cli.spmd"]
    # The benchmarks' modules are in the graph, and so are their imports of each other.
    assert "pathways_bench.report" in graph.edges["pathways_bench.suite"]
    # `import pathways as pw` inside the package resolves `pw.pmap` to where pmap is defined.
    assert "pathways.client.compiled" in graph.edges["pathways.demo"]
    assert "pathways" not in graph.edges["pathways.demo"]


def test_type_checking_imports_are_skipped() -> None:
    tree = ast.parse("if TYPE_CHECKING:\n    import pathways.a\nelse:\n    import pathways.b\n"
                     "def f():\n    import pathways.c\n")
    imported = [a.name for n in _walk_runtime(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported == ["pathways.b", "pathways.c"]


def test_cycle_is_found_and_printed_as_a_path() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    edges["c"] = set()
    assert find_cycle(edges) is None


def test_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(package_graph().edges)
    assert cycle is None, "pathways modules import each other: " + " -> ".join(cycle)


def _package(module: str) -> str:
    """The package ``module`` counts for: a subpackage of pathways (``pathways.worker``), the
    benchmarks, or a top-level module of pathways itself."""
    parts = module.split(".")
    if parts[0] != "pathways":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE_DIR / parts[1]).is_dir() else module


def test_no_two_packages_import_each_other() -> None:
    """Modules may import within their package as they like; across packages the imports
    form no cycle (a package that reaches a package that reaches it back cannot be
    understood, or tested, on its own)."""
    edges: dict[str, set[str]] = {}
    for module, targets in package_graph().edges.items():
        edges.setdefault(_package(module), set()).update(_package(t) for t in targets)
    for package, targets in edges.items():
        targets.discard(package)
        for t in targets:
            edges.setdefault(t, set())
    cycle = find_cycle(edges)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def _layer(module: str) -> int:
    """The index in LAYERS of ``module``'s layer."""
    named = [(len(name), i) for i, layer in enumerate(LAYERS) for name in layer
             if module == name or (name != "pathways" and module.startswith(name + "."))]
    if not named:
        raise LookupError(f"{module} is in no layer: name it (or its package) in LAYERS")
    return max(named)[1]


def test_layers_are_known() -> None:
    assert _layer("pathways.wire.codec") == _layer("pathways.wire.rpc") == 1
    assert _layer("pathways.protocol.streams") == _layer("pathways.ir") == _layer("pathways.timeline") == 2
    assert _layer("pathways.keeper") == _layer("pathways.table") == 3
    assert _layer("pathways.planner.schedule") < _layer("pathways.controller.core") < _layer("pathways.worker.core")
    assert _layer("pathways.worker.core") < _layer("pathways.cluster") < _layer("pathways.client.api")
    assert _layer("pathways.client.api") < _layer("pathways.ifrt.server") < _layer("pathways.conductor")
    assert _layer("pathways.conductor") < _layer("pathways") < _layer("pathways_bench.suite") < _layer("pathways.cli.bench")
    with pytest.raises(LookupError, match="is in no layer"):
        _layer("pathways_extra.module")


def test_every_module_and_role_package_has_a_layer_of_its_own() -> None:
    for module in package_graph().paths:
        _layer(module)  # raises for a module no layer names
    roles = ("pathways.planner", "pathways.controller", "pathways.worker", "pathways.cluster", "pathways.spmd",
             "pathways.client", "pathways.ifrt", "pathways.conductor")
    for role in roles:
        assert [layer for layer in LAYERS if role in layer] == [(role,)], f"{role} shares its layer"


def test_no_module_imports_a_higher_layer() -> None:
    graph = package_graph()
    upward = [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
              for module, targets in sorted(graph.edges.items()) for target in sorted(targets)
              if _layer(target) > _layer(module)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


# Role packages that must not import each other, whatever the layers allow: the controller
# serves clients and fronts, it is not built on them (the command line joins the IFRT front
# end to it, pathways/ifrt/front_end.py); a worker runs what its controller sends.
APART = {
    "pathways.controller": ("pathways.client", "pathways.ifrt", "pathways.worker"),
    "pathways.worker": ("pathways.client", "pathways.ifrt", "pathways.controller"),
}


def test_the_controller_and_the_workers_import_no_client_front_end_or_each_other() -> None:
    graph = package_graph()
    crossing = [f"{module} imports {target}" for module, targets in sorted(graph.edges.items())
                for package, others in APART.items() if module == package or module.startswith(package + ".")
                for target in sorted(targets) if any(target == o or target.startswith(o + ".") for o in others)]
    assert not crossing, "role packages importing each other:\n" + "\n".join(crossing)


def test_the_lower_layers_load_neither_jax_nor_the_client() -> None:
    """Each module of the wire and protocol layers imported in turn in a fresh process: the
    first whose import brings in JAX or the client is named."""
    modules = sorted(m for m in package_graph().paths if _layer(m) < _layer("pathways.keeper"))
    assert "pathways.wire.codec" in modules and "pathways.protocol.messages" in modules
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "    bad = sorted({n.split('.')[0] for n in sys.modules if n.split('.')[0] in ('jax', 'jaxlib')} |\n"
            "                 {n for n in sys.modules if n == 'pathways.client'})\n"
            "    if bad:\n"
            "        sys.exit(f'importing {m} loaded {bad}')\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr

