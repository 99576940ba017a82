"""Compiled functions: ``pw.pmap`` and ``pw.jit``.

A compiled function is lowered on the client with ``jax.export`` once per input signature
(pytree structure, shapes, dtypes) against an abstract mesh of its slice, registered with
the controller (which has the slice's worker compile it at once), and then called either
op by op or from inside a ``@pw.program``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, PartitionSpec
from jax.sharding import NamedSharding as JaxNamedSharding

from pathways.client.array import Array, _Buffer
from pathways.client.devices import NamedSharding, Slice, VirtualMesh, slice_of
from pathways.client.tracing import current_trace
from pathways.errors import SignatureError
from pathways.ir import Layout, ProgramGraph, Node
from pathways.platforms import export_platforms
from pathways.protocol import messages as m
from pathways.wire.codec import is_wire_dtype

Aval = tuple[tuple[int, ...], np.dtype]


@dataclass(frozen=True)
class Specialization:
    """A compiled function for one input signature, as registered on the cluster."""

    fn_id: int
    name: str
    slice: Slice
    in_layouts: tuple[Layout, ...]
    in_shardings: tuple[NamedSharding, ...]
    out_avals: tuple[Aval, ...]
    out_shardings: tuple[NamedSharding, ...]
    out_tree: Any
    single: "ProgramSpec"  # the one-node program used for op-by-op calls
    mesh: VirtualMesh
    body: Callable  # the jitted function that was exported (fusion calls it inside a larger one)


@dataclass(frozen=True)
class ProgramSpec:
    """A registered program graph plus what the client needs to make its output arrays."""

    program_id: int
    graph: ProgramGraph
    value_avals: dict[int, Aval]
    value_shardings: dict[int, NamedSharding]
    origins: dict[int, str] = field(default_factory=dict)  # output value -> the fused node computing it


class CompiledFunction:
    def __init__(self, fun: Callable, mesh: VirtualMesh, in_specs: Any, out_specs: Any, pmap_axis: Optional[str]) -> None:
        self.fun = fun
        self.mesh = mesh
        self.name = getattr(fun, "__name__", "fun")
        self._in_specs = in_specs
        self._out_specs = out_specs
        self._pmap_axis = pmap_axis
        self._cache: dict[tuple, Specialization] = {}

    @property
    def slice(self) -> Slice:
        return self.mesh.slice

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise SignatureError(f"{self.name}: pass arguments positionally; keyword arguments "
                                 f"{sorted(kwargs)} are not supported by compiled functions")
        trace = current_trace()
        if trace is not None:
            return trace.call(self, args)
        return call_op_by_op(self, args)

    def specialize(self, treedef: Any, avals: Sequence[Aval], args: tuple) -> Specialization:
        """The compiled function for this signature; ``args`` only names arguments in errors."""
        key = (treedef, tuple(avals))
        spec = self._cache.get(key)
        if spec is None:
            spec = self._lower(treedef, list(avals), arg_paths(args))
            self._cache[key] = spec
        return spec

    # ---- lowering with jax.export ----------------------------------------------------

    def _lower(self, treedef: Any, avals: list[Aval], paths: list[str]) -> Specialization:
        mesh = self.mesh
        abstract = abstract_mesh(mesh.shape, mesh.axis_names)
        if self._pmap_axis is not None:
            in_specs = [PartitionSpec(self._pmap_axis)] * len(avals)
            for (shape, _), path in zip(avals, paths):
                if not shape or shape[0] != mesh.size:
                    raise SignatureError(
                        f"{self.name}: argument {path} has shape {shape}, but pmap over "
                        f"{mesh.size} devices needs a leading axis of size {mesh.size}")
            fun, out_tree, out_avals = self._pmap_body(treedef, avals)
            out_specs = [PartitionSpec(self._pmap_axis)] * len(out_avals)
        else:
            in_specs = _flat_specs(self._in_specs, treedef, len(avals), f"{self.name}: in_shardings")
            fun, out_tree, out_avals = self._jit_body(treedef, avals)
            out_specs = _flat_specs(self._out_specs, out_tree, len(out_avals), f"{self.name}: out_shardings")
            for (shape, _), spec, path in zip(avals, in_specs, paths):
                check_divisible(self.name, f"argument {path}", shape, spec, mesh)
            for (shape, _), spec, i in zip(out_avals, out_specs, itertools.count()):
                check_divisible(self.name, f"output {i}", shape, spec, mesh)
        in_sh = [JaxNamedSharding(abstract, s) for s in in_specs]
        out_sh = [JaxNamedSharding(abstract, s) for s in out_specs]
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for (shape, dtype), s in zip(avals, in_sh)]
        body = jax.jit(fun, in_shardings=in_sh, out_shardings=out_sh)
        try:
            # For the slice's device kind, not this client's: a CPU-only client compiles for GPU workers.
            exported = jax.export.export(body, platforms=export_platforms(self.slice.kind))(*args)
        except Exception as e:
            raise SignatureError(f"{self.name} could not be compiled for arguments "
                                 f"{_describe(avals, paths)}: {type(e).__name__}: {e}") from e
        session = self.slice.session
        in_layouts = tuple(self.slice.layout(mesh.shape, mesh.axis_names, s) for s in in_specs)
        out_layouts = tuple(self.slice.layout(mesh.shape, mesh.axis_names, s) for s in out_specs)
        fn_id = define_function(session, self.slice.id, self.name, exported, in_layouts, out_layouts)
        out_shardings = tuple(NamedSharding(mesh, s) for s in out_specs)
        n_in, n_out = len(avals), len(out_avals)
        graph = ProgramGraph(n_in + n_out, tuple(range(n_in)),
                             (Node(fn_id, tuple(range(n_in)), tuple(range(n_in, n_in + n_out))),),
                             tuple(range(n_in, n_in + n_out)), value_types([*avals, *out_avals]))
        single = register_program(session, graph,
                                  {n_in + i: a for i, a in enumerate(out_avals)},
                                  {n_in + i: s for i, s in enumerate(out_shardings)})
        return Specialization(fn_id, self.name, self.slice, in_layouts,
                              tuple(NamedSharding(mesh, s) for s in in_specs),
                              tuple(out_avals), out_shardings, out_tree, single, mesh, body)

    def _pmap_body(self, treedef: Any, avals: list[Aval]) -> tuple[Callable, Any, list[Aval]]:
        fun, axis, mesh = self.fun, self._pmap_axis, self.mesh

        def per_shard(*leaves: Any) -> Any:
            return fun(*jax.tree.unflatten(treedef, leaves))

        # vmap binds the axis name, so collectives trace; it maps the same leading axis.
        out = _eval_shape(self.name, jax.vmap(per_shard, axis_name=axis),
                          [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals], avals)
        out_leaves, out_tree = jax.tree.flatten(out)
        out_avals = [(tuple(o.shape), np.dtype(o.dtype)) for o in out_leaves]
        abstract = abstract_mesh(mesh.shape, mesh.axis_names)

        def block(*blocks: Any) -> list:
            result = per_shard(*[b[0] for b in blocks])
            return [leaf[None] for leaf in jax.tree.leaves(result)]

        # pmap semantics: no tracking of which values vary across the axis, so that, as
        # with jax.pmap, a collective's result can be a loop carry.
        body = jax.shard_map(block, mesh=abstract, in_specs=tuple(PartitionSpec(axis) for _ in avals),
                             out_specs=[PartitionSpec(axis)] * len(out_avals), check_vma=False)
        return body, out_tree, out_avals

    def _jit_body(self, treedef: Any, avals: list[Aval]) -> tuple[Callable, Any, list[Aval]]:
        fun = self.fun

        def flat(*leaves: Any) -> list:
            return jax.tree.leaves(fun(*jax.tree.unflatten(treedef, leaves)))

        out = _eval_shape(self.name, lambda *ls: fun(*jax.tree.unflatten(treedef, ls)),
                          [jax.ShapeDtypeStruct(s, d) for s, d in avals], avals)
        out_leaves, out_tree = jax.tree.flatten(out)
        return flat, out_tree, [(tuple(o.shape), np.dtype(o.dtype)) for o in out_leaves]


def abstract_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> AbstractMesh:
    """The abstract mesh a function is exported for. Its axes are Auto, as a worker's concrete
    ``jax.sharding.Mesh`` is: jax 0.12 made AbstractMesh's default Explicit, which refuses
    ``with_sharding_constraint`` on its axes and would not match the worker's mesh."""
    return AbstractMesh(tuple(shape), tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def arg_paths(tree: Any) -> list[str]:
    """Readable paths of the leaves of ``tree``, such as ``[0]['w']``."""
    return [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def value_types(avals: Sequence[Aval]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The program graph's (dtype name, shape) of each value."""
    return tuple((np.dtype(dtype).name, tuple(shape)) for shape, dtype in avals)


def define_function(session: Any, slice_id: int, name: str, exported: Any, in_layouts: Sequence[Layout],
                    out_layouts: Sequence[Layout]) -> int:
    """Register ``exported`` (a ``jax.export.Exported``) on slice ``slice_id`` as the function
    ``name``, whose parameters and results the workers lay out as ``in_layouts`` and
    ``out_layouts``; returns the id programs call it by. The one way a function reaches the
    workers: from ``pw.jit``/``pw.pmap``, a fused program, and the IFRT front end."""
    fn_id = session.allocate(1)
    session.send(m.DefineFunction(fn_id, slice_id, m.FunctionBody(name, bytes(exported.serialize()),
                                                                  tuple(in_layouts), tuple(out_layouts))))
    return fn_id


def register_program(session: Any, graph: ProgramGraph, value_avals: dict[int, Aval],
                     value_shardings: dict[int, NamedSharding], dispatch: str = "parallel",
                     origins: Optional[dict[int, str]] = None) -> ProgramSpec:
    program_id = session.allocate(1)
    session.send(m.DefineProgram(program_id, graph, dispatch))
    return ProgramSpec(program_id, graph, value_avals, value_shardings, origins or {})


def _eval_shape(name: str, fun: Callable, args: list, avals: list[Aval]) -> Any:
    try:
        return jax.eval_shape(fun, *args)
    except Exception as e:
        raise SignatureError(f"{name} failed to trace for arguments of shapes "
                             f"{[list(s) for s, _ in avals]}: {type(e).__name__}: {e}") from e


def _describe(avals: list[Aval], paths: list[str]) -> str:
    return ", ".join(f"{p}: {d}{list(s)}" for (s, d), p in zip(avals, paths))


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _flat_specs(specs: Any, treedef: Any, n: int, what: str) -> list[PartitionSpec]:
    """Broadcast a spec, or a pytree prefix of specs, to ``n`` flat leaves of ``treedef``."""
    if _is_spec_leaf(specs):
        return [specs or PartitionSpec()] * n
    try:
        full = jax.tree.broadcast(specs, jax.tree.unflatten(treedef, [0] * n), is_leaf=_is_spec_leaf)
        flat = jax.tree.leaves(full, is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as e:
        # As jax.jit says: in_shardings is a prefix of the tuple of arguments, so the specs of
        # one dict or list argument must be wrapped in a one-element tuple.
        tip = (f"; in_shardings is a prefix of the tuple of arguments: for one {type(specs).__name__} argument, "
               f"wrap its specs in a one-element tuple, in_shardings=({specs!r},)"
               if what.endswith("in_shardings") and not isinstance(specs, tuple) else "")
        raise SignatureError(f"{what} does not match the structure {treedef}: {e}{tip}") from None
    if len(flat) != n:
        raise SignatureError(f"{what} gives {len(flat)} specs for {n} arrays of structure {treedef}")
    return [s or PartitionSpec() for s in flat]


def host_array(leaf: Any) -> np.ndarray:
    """``leaf`` as a numpy array with JAX's canonical dtype; TypeError says why it is not one."""
    try:
        value = np.asarray(leaf)
    except Exception as e:
        raise TypeError(f"is a {type(leaf).__name__}, not an array: {e}") from None
    if not is_wire_dtype(value.dtype):
        raise TypeError(f"is a {type(leaf).__name__} of dtype {value.dtype}, not an array of numbers")
    return value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)


def check_divisible(name: str, what: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: VirtualMesh) -> None:
    if len(spec) > len(shape):
        raise SignatureError(f"{name}: {what} has shape {shape} but its partition spec {spec} has "
                             f"{len(spec)} entries")
    for dim, entry in zip(shape, spec):
        try:
            parts = mesh.axis_size(entry)
        except ValueError:
            raise SignatureError(f"{name}: partition spec {spec} names an axis not in mesh "
                                 f"{mesh.axis_names}") from None
        if dim % parts:
            raise SignatureError(f"{name}: {what} has shape {shape}; dimension {dim} does not "
                                 f"divide into {parts} parts as partition spec {spec} asks")


def pmap(fun: Callable, devices: Any, axis_name: str = "i") -> CompiledFunction:
    """Map ``fun`` over the leading axis of its arguments, one slice device per entry."""
    s = slice_of(devices, "pmap's devices")
    return CompiledFunction(fun, VirtualMesh(s, (s.count,), (axis_name,)), None, None, axis_name)


def jit(fun: Callable, mesh: VirtualMesh, in_shardings: Any = None, out_shardings: Any = None) -> CompiledFunction:
    """Compile ``fun`` for ``mesh`` (from ``slice.mesh(...)``) with PartitionSpec shardings.

    ``in_shardings``/``out_shardings``: a PartitionSpec for every array, or a pytree prefix
    of PartitionSpecs; None means replicated.
    """
    if not isinstance(mesh, VirtualMesh):
        raise SignatureError(f"jit's mesh must come from slice.mesh(axis_names), got {type(mesh).__name__}")
    return CompiledFunction(fun, mesh, in_shardings, out_shardings, None)


def call_op_by_op(fn: CompiledFunction, args: tuple) -> Any:
    """Call ``fn`` outside a program: host arguments are put on its slice, then its one-node program runs."""
    session = fn.slice.session
    leaves, treedef = jax.tree.flatten(args)
    avals = arg_avals(leaves, args, fn.name)
    spec = fn.specialize(treedef, avals, args)
    inputs = []
    for leaf, layout, sharding, aval in zip(leaves, spec.in_layouts, spec.in_shardings, avals):
        if isinstance(leaf, Array):
            if leaf._buffer.session is not session:
                raise SignatureError(f"{fn.name}: an argument belongs to another session")
            inputs.append(leaf)
        else:
            inputs.append(session.put_layout(np.asarray(leaf, dtype=aval[1]), layout, sharding))
    return jax.tree.unflatten(spec.out_tree, run(session, spec.single, inputs))


def run(session: Any, spec: ProgramSpec, inputs: Sequence[Array]) -> list[Array]:
    """Submit one run of ``spec`` with ``inputs`` bound to the graph's inputs, in order."""
    graph = spec.graph
    session._refuse_if_suspended("run a program")
    for arr in inputs:
        arr._live()
    base = session.allocate(graph.nvalues)
    bound = dict(zip(graph.inputs, inputs))
    session.submit(spec.program_id, base, {v: arr.handle for v, arr in bound.items()},
                   f"program {spec.program_id:#x}")
    outs = []
    for v in graph.outputs:
        if v in bound:
            outs.append(bound[v])
            continue
        sharding = spec.value_shardings[v]
        shape, dtype = spec.value_avals[v]
        out = Array(_Buffer(session, base + v, sharding.mesh.slice), shape, dtype, sharding)
        if v in spec.origins:
            out._origin = spec.origins[v]
        outs.append(out)
    if session.traced:
        session.recordings.watch(outs)
    return outs


def arg_avals(leaves: list, args: tuple, callee: str) -> list[Aval]:
    """The (shape, dtype) of each leaf of ``args`` as it will be sent; SignatureError names one that is not an array."""
    avals = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Array):
            avals.append((leaf.shape, leaf.dtype))
            continue
        try:
            arr = host_array(leaf)
        except TypeError as e:
            raise SignatureError(f"argument {arg_paths(args)[i]} of {callee} {e}") from None
        avals.append((arr.shape, arr.dtype))
    return avals
