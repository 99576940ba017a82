"""``@pw.program``: trace calls of compiled functions into one graph, submitted as one run.

Tracing records one node per compiled-function call (one per sharded computation, not per
shard). The graph is traced once per input signature and registered with the controller;
every later call is a single ``run`` message naming it, fire and forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import numpy as np

from pathways.client import api
from pathways.client.array import Array
from pathways.client.compiled import (Aval, CompiledFunction, ProgramSpec, Specialization, arg_avals,
                                      arg_paths, register_program, run, value_types)
from pathways.client.devices import NamedSharding
from pathways.client.fusion import fuse_graph
from pathways.client.tracing import current_trace, tracing
from pathways.errors import ProgramTraceError
from pathways.ir import DISPATCH_MODES, Layout, Node, ProgramGraph, too_many_nodes
from pathways.timeline import now


class Traced:
    """A value inside a program being traced: it has a shape and dtype, but no data."""

    __slots__ = ("_trace", "_value", "shape", "dtype")

    def __init__(self, trace: "_Trace", value: int, aval: Aval) -> None:
        self._trace, self._value = trace, value
        self.shape, self.dtype = aval

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise ProgramTraceError(
            f"a traced value ({self.dtype}{list(self.shape)}) was used outside a compiled function. "
            "Inside @pw.program only calls of pw.pmap/pw.jit functions are allowed: move this "
            "computation into a compiled function and call that")

    def __repr__(self) -> str:
        return f"Traced({self.dtype}{list(self.shape)})"


for _name in ("__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
              "__floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __matmul__ __rmatmul__ "
              "__neg__ __pos__ __abs__ __invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ "
              "__lt__ __le__ __gt__ __ge__ __getitem__ __setitem__ __iter__ __len__ __bool__ "
              "__int__ __float__ __complex__ __index__ __array__").split():
    setattr(Traced, _name, Traced._refuse)


@dataclass
class _Trace:
    session: Any
    nvalues: int = 0
    inputs: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    avals: dict[int, Aval] = field(default_factory=dict)
    shardings: dict[int, NamedSharding] = field(default_factory=dict)
    placement: dict[int, Layout] = field(default_factory=dict)  # input -> first consumer's layout
    captured: dict[int, Array] = field(default_factory=dict)  # value -> array closed over
    specs: dict[int, Specialization] = field(default_factory=dict)  # function id -> its specialization

    def new_value(self, aval: Aval) -> int:
        v = self.nvalues
        self.nvalues += 1
        self.avals[v] = aval
        return v

    def value_of(self, leaf: Any, path: str, callee: str) -> int:
        if isinstance(leaf, Traced):
            if leaf._trace is not self:
                raise ProgramTraceError(f"argument {path} of {callee} comes from another program's trace")
            return leaf._value
        if isinstance(leaf, Array):
            for v, arr in self.captured.items():
                if arr._buffer is leaf._buffer:
                    return v
            v = self.new_value((leaf.shape, leaf.dtype))
            self.inputs.append(v)
            self.captured[v] = leaf
            return v
        raise ProgramTraceError(
            f"argument {path} of {callee} is a {type(leaf).__name__}; inside @pw.program, compiled "
            "functions take only the program's arguments, other compiled functions' results, or "
            "pw.Arrays. Pass it as an argument of the program, or pw.device_put it first")

    def call(self, fn: CompiledFunction, args: tuple) -> Any:
        if fn.slice.session is not self.session:
            raise ProgramTraceError(f"{fn.name} belongs to another session than this program")
        leaves, treedef = jax.tree.flatten(args)
        values = [self.value_of(leaf, p, fn.name) for leaf, p in zip(leaves, arg_paths(args))]
        spec = fn.specialize(treedef, [self.avals[v] for v in values], args)
        self.specs[spec.fn_id] = spec
        for v, layout in zip(values, spec.in_layouts):
            if v in self.inputs:
                self.placement.setdefault(v, layout)
                self.shardings.setdefault(v, spec.in_shardings[values.index(v)])
        outs = []
        for aval, sharding in zip(spec.out_avals, spec.out_shardings):
            v = self.new_value(aval)
            self.shardings[v] = sharding
            outs.append(v)
        self.nodes.append(Node(spec.fn_id, tuple(values), tuple(outs)))
        return jax.tree.unflatten(spec.out_tree, [Traced(self, v, self.avals[v]) for v in outs])


@dataclass(frozen=True)
class _Traced:
    spec: ProgramSpec
    out_tree: Any
    arg_values: tuple[int, ...]
    captured: dict[int, Array]
    placement: dict[int, Layout]
    shardings: dict[int, NamedSharding]


class Program:
    """A traced multi-computation program; calling it submits one run to the controller."""

    def __init__(self, fun: Callable, dispatch: str = "parallel", fuse: bool = False) -> None:
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch={dispatch!r}: choose 'parallel' (every node is sent to its "
                             "workers at once) or 'sequential' (a node is sent once its predecessors "
                             "have finished; a baseline for comparison)")
        if not isinstance(fuse, bool):
            raise ValueError(f"fuse={fuse!r}: pass True to compile consecutive nodes of a slice into one "
                             "executable, or False (the default) for one executable per node")
        self.fun = fun
        self.dispatch = dispatch
        self.fuse = fuse
        self.__name__ = getattr(fun, "__name__", "program")
        self.__doc__ = getattr(fun, "__doc__", None)
        self._cache: dict[tuple, _Traced] = {}

    def __call__(self, *args: Any) -> Any:
        if current_trace() is not None:
            raise ProgramTraceError(f"program {self.__name__} was called while tracing another "
                                    "program; call its compiled functions directly instead")
        session = api.default_session()
        leaves, treedef = jax.tree.flatten(args)
        avals = arg_avals(leaves, args, self.__name__)
        key = (treedef, tuple(avals))
        traced = self._cache.get(key)
        if traced is None:
            began = now()
            traced = self._trace(session, treedef, avals, arg_paths(args))
            self._cache[key] = traced
            if session.traced:
                session.recorder.span("trace", began, 0, f"program {self.__name__}")
        inputs: list[Array] = []
        for v, leaf in zip(traced.arg_values, leaves):
            if isinstance(leaf, Array):
                inputs.append(leaf)
            else:
                inputs.append(session.put_layout(np.asarray(leaf, dtype=avals[v][1]),
                                                 traced.placement[v], traced.shardings[v]))
        inputs.extend(traced.captured.values())
        outs = run(session, traced.spec, inputs)
        return jax.tree.unflatten(traced.out_tree, outs)

    def _trace(self, session: Any, treedef: Any, avals: list[Aval], paths: list[str]) -> _Traced:
        trace = _Trace(session)
        arg_values = []
        for aval in avals:
            v = trace.new_value(aval)
            trace.inputs.append(v)
            arg_values.append(v)
        try:
            with tracing(trace):
                result = self.fun(*jax.tree.unflatten(treedef, [Traced(trace, v, trace.avals[v]) for v in arg_values]))
        except ProgramTraceError as e:  # raised by a traced value (e.g. np.sin(x)) or a call: name the program
            if str(e).startswith(f"program {self.__name__} "):
                raise
            raise ProgramTraceError(f"program {self.__name__}: {e}").with_traceback(e.__traceback__) from None
        except (TypeError, ValueError) as e:
            if "Traced(" not in str(e):
                raise
            raise ProgramTraceError(
                f"program {self.__name__} passed a traced value to a JAX or NumPy function, so it was "
                "used outside a compiled function. Inside @pw.program only calls of pw.pmap/pw.jit "
                f"functions are allowed: move this computation into a compiled function ({e})") from e
        out_leaves, out_tree = jax.tree.flatten(result)
        outputs = [trace.value_of(leaf, p, f"{self.__name__}'s result")
                   for leaf, p in zip(out_leaves, arg_paths(result))]
        if not trace.nodes:
            raise ProgramTraceError(f"program {self.__name__} calls no compiled function")
        unused = [paths[i] for i, v in enumerate(arg_values) if v not in trace.placement]
        if unused:
            raise ProgramTraceError(f"program {self.__name__}: argument(s) {', '.join(unused)} are never "
                                    "passed to a compiled function; drop them from the signature")
        graph = ProgramGraph(trace.nvalues, tuple(trace.inputs), tuple(trace.nodes), tuple(outputs),
                             value_types([trace.avals[v] for v in range(trace.nvalues)]))
        origins: dict[int, str] = {}
        if self.fuse:
            graph, origins = fuse_graph(session, graph, trace.specs, trace.avals, self.__name__)
        if too_many_nodes(len(graph.nodes)):
            raise ProgramTraceError(f"program {self.__name__}: {too_many_nodes(len(graph.nodes))}")
        spec = register_program(session, graph, trace.avals, trace.shardings, self.dispatch, origins)
        return _Traced(spec, out_tree, tuple(arg_values), trace.captured, trace.placement, trace.shardings)


def program(fun: Optional[Callable] = None, *, dispatch: str = "parallel", fuse: bool = False) -> Any:
    """Decorator: ``@pw.program`` or ``pw.program(fun, dispatch="parallel" | "sequential", fuse=False)``.

    ``parallel`` (the default) sends every node of a run to its workers in one step; a node
    waits on its workers only for its input data. ``sequential`` sends a node only after
    all the nodes it reads from have finished, a controller round trip per node: the
    baseline that shows what parallel dispatch saves.

    ``fuse=True`` compiles consecutive nodes of one slice (and mesh), joined by values that
    nothing else reads (no program output, no node on another slice), into one executable:
    fewer nodes to dispatch and execute, the same results.
    """
    if fun is None:
        return lambda f: Program(f, dispatch, fuse)
    return Program(fun, dispatch, fuse)
