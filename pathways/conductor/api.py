"""``pw.conduct``: run an unannotated JAX function sharded over a slice by a cost model.

On the first call for an input signature the function is traced (``graph.trace``), every
operation's candidate shardings are priced on each mesh shape of the slice's devices
(``pricing``), and the planner's exact solver (``pathways.planner.sharding``) picks one
candidate per operation: least predicted time, under ``memory_limit`` bytes per device when
given. The plan runs as one sharded computation: the function re-evaluated with a sharding
constraint on every value the plan places and ring attention where the plan chose it,
compiled by ``pw.jit`` on the slice (or ``jax.jit`` on JAX devices, such as those an IFRT
proxy serves).

Plans are cached per input signature. When the slice moves (its island healed, its session
resumed elsewhere) or ``replan`` is given other figures, the traced graph is kept and the
solver starts from the previous plan as a hint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pathways.conductor import pricing
from pathways.conductor.graph import Graph, evaluate, trace
from pathways.conductor.pricing import Candidate, Figures, Mesh
from pathways.errors import SignatureError

OBJECTIVES = ("time",)
# Re-planning from a previous plan gives the solver this share of what the cold solve of the
# same mesh shape took (and no less than the floor): the previous plan is the solver's
# starting point, so it returns a plan at least as good as that one re-priced, proven
# optimal when the proof fits in the time, with its gap otherwise.
REPLAN_SHARE = 0.15
REPLAN_FLOOR = 0.05  # seconds
# Figures for JAX devices the cluster has not measured (those of another runtime): a
# network link between processes, and a modest CPU.
ASSUMED_FLOPS = 1e10
ASSUMED_LATENCY = 20e-6
ASSUMED_BANDWIDTH = 1e9


@dataclass(frozen=True)
class PlannedOperation:
    """One operation of a plan, as ``Plan.__str__`` prints it."""

    name: str
    sharding: str
    collectives: tuple[str, ...]
    seconds: float  # predicted: its computation, its own collectives and the resharding of its operands
    working_bytes: float


@dataclass
class Plan:
    """The sharding chosen for one input signature: per-operation choices, the mesh, the
    predicted time and peak memory per device, and how to run it."""

    graph: Graph = field(repr=False)
    mesh: Mesh
    choices: tuple[int, ...]
    candidates: list[list[Candidate]] = field(repr=False)
    predicted_seconds: float
    peak_bytes: float
    optimal: bool  # proven optimal on its mesh shape, each of the others proven no better
    bound: float
    solve_seconds: float  # the solver's time, over every mesh shape
    planning_seconds: float  # everything: tracing (cold plans), pricing and solving
    ring_orders: dict[str, tuple[int, ...]]
    in_tree: Any = field(repr=False)
    out_tree: Any = field(repr=False)
    hinted: bool = False  # the solver started from a previous plan
    solutions: dict = field(default_factory=dict, repr=False)  # mesh shape -> the best choices found on it
    _compiled: dict = field(default_factory=dict, repr=False)

    # ---- what was chosen ------------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.mesh.axes

    @property
    def gap(self) -> float:
        """How far the plan may be from the optimum, relative (0 when proven optimal)."""
        return 0.0 if self.optimal else (self.predicted_seconds - self.bound) / max(self.predicted_seconds, 1e-300)

    def chosen(self, index: int) -> Candidate:
        return self.candidates[index][self.choices[index]]

    @property
    def uses_ring_attention(self) -> bool:
        return any(self.chosen(i).ring is not None for i in range(len(self.choices)))

    @property
    def in_specs(self) -> list[PartitionSpec]:
        ops = self.graph.operations
        return [PartitionSpec(*self.chosen(i).result_specs[0]) for i, op in enumerate(ops) if op.kind == "input"]

    @property
    def out_specs(self) -> list[PartitionSpec]:
        specs = {op.operands[0]: PartitionSpec(*self.chosen(i).operand_specs[0])
                 for i, op in enumerate(self.graph.operations) if op.kind == "output"}
        return [specs.get(v, PartitionSpec()) if not _is_literal(v) else PartitionSpec()
                for v in self.graph.jaxpr.outvars]

    @property
    def operations(self) -> list[PlannedOperation]:
        """Each operation with its sharding, the collectives it brings and its predicted cost."""
        out = []
        ops = self.graph.operations
        incoming = _incoming(self.graph)
        for i, op in enumerate(ops):
            c = self.chosen(i)
            collectives = [f"all-reduce over {a}" for a in c.reduce_over]
            if c.ring is not None:
                collectives.append(f"ring of ppermutes over {c.ring} in order {list(self.ring_orders[c.ring])}")
            seconds = c.seconds
            for j, (p, r) in enumerate(incoming[i]):
                src = self.chosen(p).result_specs[r]
                dst = c.operand_specs[j]
                moved = pricing.reshard_seconds(self.graph.value_bytes(op.operands[j]), src, dst, self.mesh)
                if moved > 0:
                    seconds += moved
                    collectives.append(f"operand {j} {pricing.show(src)} -> {pricing.show(dst)}")
            out.append(PlannedOperation(op.name, c.label, tuple(collectives), seconds, c.working_bytes))
        return out

    def __str__(self) -> str:
        rows = [(o.name, o.sharding, "; ".join(o.collectives), f"{o.seconds * 1e6:.1f}", _mib(o.working_bytes))
                for o in self.operations]
        head = ("operation", "sharding", "collectives", "us", "working MiB")
        widths = [max(len(str(r[k])) for r in [head, *rows]) for k in range(5)]
        lines = [f"plan on mesh {dict(zip(self.mesh.axes, self.mesh.shape))}: predicted "
                 f"{self.predicted_seconds * 1e3:.3f} ms per call, peak {_mib(self.peak_bytes)} MiB per device, "
                 + ("optimal" if self.optimal else f"within {self.gap:.1%} of optimal")
                 + (", ring attention" if self.uses_ring_attention else "")
                 + f" (solved in {self.solve_seconds:.2f} s, planned in {self.planning_seconds:.2f} s)"]
        for r in [head, *rows]:
            lines.append("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    # ---- running it -----------------------------------------------------------------------

    def jax_fun(self, mesh: jax.sharding.Mesh | AbstractMesh) -> Callable:
        """The function, sharded as planned over ``mesh`` (axes ``axis_names``, shape
        ``mesh_shape``), taking and returning the original pytrees; differentiable."""
        if tuple(mesh.axis_names) != self.mesh.axes or tuple(mesh.axis_sizes) != self.mesh.shape:
            raise SignatureError(f"the plan is for a mesh {dict(zip(self.mesh.axes, self.mesh.shape))}; "
                                 f"got {dict(zip(mesh.axis_names, mesh.axis_sizes))}")
        flat = _emit(self, mesh)
        in_tree, out_tree = self.in_tree, self.out_tree

        def fun(*args: Any) -> Any:
            leaves, tree = jax.tree.flatten(args)
            if tree != in_tree:
                raise SignatureError(f"the plan is for arguments of structure {in_tree}, got {tree}")
            return jax.tree.unflatten(out_tree, flat(*leaves))

        return fun

    def shardings(self, mesh: jax.sharding.Mesh | AbstractMesh) -> tuple[Any, Any]:
        """(in_shardings, out_shardings) for ``jax.jit(plan.jax_fun(mesh), ...)``, as pytrees."""
        ins = jax.tree.unflatten(self.in_tree, [NamedSharding(mesh, s) for s in self.in_specs])
        outs = jax.tree.unflatten(self.out_tree, [NamedSharding(mesh, s) for s in self.out_specs])
        return ins, outs


class ConductedFunction:
    """What ``pw.conduct`` returns: call it like the function; ``.plan`` is the last call's plan."""

    def __init__(self, fun: Callable, devices: Any, memory_limit: Optional[float], objective: str,
                 topology: Any, time_limit: float) -> None:
        self.fun = fun
        self.name = getattr(fun, "__name__", "fun")
        self.memory_limit = memory_limit
        self.objective = objective
        self.time_limit = time_limit
        self._topology = topology
        self._slice, self._jax_devices = _devices(devices)
        self._graphs: dict[tuple, Graph] = {}  # signature -> its traced graph, kept when re-planning
        self._out_trees: dict[tuple, Any] = {}
        self._cold_solves: dict[tuple, dict] = {}  # signature -> mesh shape -> seconds its cold solve took
        self._plans: dict[tuple, Plan] = {}
        self._placed: dict[tuple, Any] = {}  # signature -> where the plan was made (slice placement)
        self._last: Optional[Plan] = None

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise SignatureError(f"{self.name} has no plan yet: call it, or call plan_for(*args) with arrays "
                                 "or jax.ShapeDtypeStruct of the arguments' shapes")
        return self._last

    def plan_for(self, *args: Any) -> Plan:
        """The plan for arguments like ``args`` (arrays or ``jax.ShapeDtypeStruct``), made if needed."""
        leaves, tree = jax.tree.flatten(args)
        avals = tuple(_aval(x, i) for i, x in enumerate(leaves))
        key = (tree, avals)
        placed = self._placement()
        plan = self._plans.get(key)
        if plan is None or self._placed.get(key) != placed:
            plan = self._make(key, tree, avals, hint=plan)
            self._plans[key], self._placed[key] = plan, placed
        self._last = plan
        return plan

    def replan(self, topology: Any = None, time_limit: Optional[float] = None) -> Plan:
        """Plan the last signature again with new figures (``topology``, or the cluster's as
        they stand), starting from the current plan with ``REPLAN_SHARE`` of the cold
        solve's time, or ``time_limit`` seconds per mesh shape."""
        plan = self.plan
        self._topology = topology
        key = next(k for k, p in self._plans.items() if p is plan)
        new = self._make(key, plan.in_tree, key[1], hint=plan, time_limit=time_limit)
        self._plans[key] = self._last = new
        return new

    @property
    def jax_fun(self) -> Callable:
        """The last plan as a plain JAX function on these JAX devices (see ``shardings``)."""
        return self.plan.jax_fun(self._jax_mesh(self.plan))

    @property
    def shardings(self) -> tuple[Any, Any]:
        return self.plan.shardings(self._jax_mesh(self.plan))

    def __call__(self, *args: Any) -> Any:
        plan = self.plan_for(*args)
        return self._compiled(plan, "call", lambda f: f, keep_out_shardings=True)(*args)

    def grad(self, argnums: int | Sequence[int] = 0) -> Callable:
        """A function returning ``jax.grad`` of the conducted function (which must return a
        scalar) with respect to ``argnums``, run as planned: the forward pass's shardings
        and ring attention, and their transposes for the backward pass."""
        key = ("grad", argnums if isinstance(argnums, int) else tuple(argnums))

        def grad_fun(*args: Any) -> Any:
            plan = self.plan_for(*args)
            return self._compiled(plan, key, lambda f: jax.grad(f, argnums), keep_out_shardings=False)(*args)

        return grad_fun

    def _compiled(self, plan: Plan, key: Any, wrap: Callable, keep_out_shardings: bool) -> Callable:
        """``wrap`` of the planned function, compiled once per plan: by ``pw.jit`` on the slice,
        or ``jax.jit`` on the JAX devices. Its outputs keep the plan's shardings when
        ``keep_out_shardings``; otherwise the compiler chooses."""
        run = plan._compiled.get(key)
        if run is not None:
            return run
        if self._slice is None:
            mesh = self._jax_mesh(plan)
            ins, outs = plan.shardings(mesh)
            run = jax.jit(wrap(plan.jax_fun(mesh)), in_shardings=ins, out_shardings=outs if keep_out_shardings else None)
        else:
            run = _on_slice(self._slice, plan, wrap, plan.out_specs if keep_out_shardings else None)
        plan._compiled[key] = run
        return run

    # ---- planning -------------------------------------------------------------------------

    def _placement(self) -> Any:
        return None if self._slice is None else self._slice._physical

    def _make(self, key: tuple, tree: Any, avals: tuple, hint: Optional[Plan],
              time_limit: Optional[float] = None) -> Plan:
        from pathways.planner.ring import best_ring
        from pathways.planner.sharding import Operation, solve_sharding
        from pathways.planner.topology import PlanError

        began = time.perf_counter()
        graph = self._graphs.get(key)
        if graph is None:
            structs = [jax.ShapeDtypeStruct(s, d) for s, d in avals]

            out_tree: list = []

            def flat(*leaves: Any) -> list:
                out = self.fun(*jax.tree.unflatten(tree, leaves))
                out_tree.append(jax.tree.structure(out))
                return jax.tree.leaves(out)

            try:
                graph = trace(flat, structs)
            except Exception as e:
                raise SignatureError(f"{self.name} could not be traced for arguments {_describe(avals)}: "
                                     f"{type(e).__name__}: {e}") from e
            self._graphs[key] = graph
            self._out_trees[key] = out_tree[0]
        figures = self._figures()
        best: Optional[Plan] = None
        failures = []
        solutions: dict[tuple[int, ...], tuple[int, ...]] = {}
        bounds = []  # the proven lower bound of each mesh shape's optimum
        solve_seconds = 0.0
        for mesh in pricing.meshes(figures.count, figures):
            orders = {a: _ring_order(best_ring, figures, mesh, a) for a in mesh.axes if mesh.size(a) > 1}

            def hop(axis: str, orders: dict = orders, mesh: Mesh = mesh) -> tuple[float, float]:
                return _slowest_hop(figures, mesh, axis, orders[axis])

            cands = [pricing.candidates(graph, op, mesh, figures, hop) for op in graph.operations]
            ops = [Operation(op.name, tuple(_as_choice(c) for c in cs)) for op, cs in zip(graph.operations, cands)]
            transfers = _transfers(graph, cands, mesh)
            previous = hint.solutions.get(mesh.shape) if hint is not None else None
            cold = self._cold_solves.setdefault(key, {})
            limit = self.time_limit if time_limit is None else time_limit
            if previous is not None and mesh.shape in cold and time_limit is None:
                limit = min(limit, max(REPLAN_FLOOR, REPLAN_SHARE * cold[mesh.shape]))
            try:
                solution = solve_sharding(ops, transfers, memory_limit=self.memory_limit, time_limit=limit,
                                          hint=previous)
            except PlanError as e:
                failures.append(f"mesh {mesh.shape}: {e}")
                continue
            solve_seconds += solution.solve_seconds
            cold.setdefault(mesh.shape, solution.solve_seconds)
            solutions[mesh.shape] = solution.choices
            bounds.append(solution.bound)
            if best is None or solution.seconds < best.predicted_seconds:
                best = Plan(graph, mesh, solution.choices, cands, solution.seconds, solution.peak_bytes,
                            solution.optimal, solution.bound, 0.0, 0.0, orders, tree, self._out_trees[key])
        if best is None:
            raise PlanError(f"{self.name}: no sharding over {figures.count} device(s) fits: " + "; ".join(failures))
        best.solutions, best.solve_seconds = solutions, solve_seconds
        best.bound = float(min(bounds))
        best.optimal = bool(best.bound >= best.predicted_seconds * (1 - 1e-9))
        best.hinted = hint is not None and any(shape in hint.solutions for shape in solutions)
        best.planning_seconds = time.perf_counter() - began
        return best

    def _figures(self) -> Figures:
        if self._slice is not None:
            return _slice_figures(self._slice, self._topology)
        return _jax_figures(self._jax_devices, self._topology)

    def _jax_mesh(self, plan: Plan) -> jax.sharding.Mesh:
        if self._slice is not None:
            raise SignatureError("this function is conducted over a pathways slice: use plan.jax_fun(mesh) "
                                 "with a mesh of your own JAX devices, or call the function")
        return jax.sharding.Mesh(np.array(self._jax_devices).reshape(plan.mesh.shape), plan.mesh.axes)


def conduct(fun: Callable, devices: Any, *, memory_limit: Optional[float] = None, objective: str = "time",
            topology: Any = None, time_limit: float = 30.0) -> ConductedFunction:
    """Shard ``fun`` over ``devices`` automatically.

    ``devices``: a slice's devices (``slice.devices``), or a sequence of JAX devices (then the
    function runs with ``jax.jit``, through an IFRT proxy too). ``memory_limit``: bytes per
    device the plan may use at its peak. ``topology``: a ``pathways.planner.Topology`` to
    price with (by default the cluster's measured figures; for JAX devices, device ids
    ``"0"``..``"n-1"`` in the order given). ``time_limit``: seconds the solver may take per
    mesh shape; past it the best plan found is used and ``plan.gap`` says how far from
    optimal it may be.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ValueError(f"memory_limit must be a positive number of bytes per device, got {memory_limit!r}")
    return ConductedFunction(fun, devices, memory_limit, objective, topology, time_limit)


# ---- emission -------------------------------------------------------------------------------


def _emit(plan: Plan, mesh: Any) -> Callable:
    """The flat function: the jaxpr evaluated with each planned value constrained to its
    spec and attention replaced by ring attention where chosen."""
    from pathways.conductor.ring_attention import ring_attention

    graph = plan.graph
    specs: dict = {}
    rings: dict = {}
    skipped: set = set()
    for i, op in enumerate(graph.operations):
        c = plan.chosen(i)
        if op.kind in ("input", "output"):
            continue
        for v, s in zip(op.results, c.result_specs):
            specs[v] = s
        if c.ring is not None:
            rings[id(op.eqns[-1])] = (op, c)
            skipped.update(id(e) for e in op.eqns[:-1])

    def constrain(var: Any, value: Any) -> Any:
        spec = specs.get(var)
        if spec is None:
            return value
        return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, PartitionSpec(*spec)))

    def on_eqn(eqn: Any, values: list, read: Callable) -> list:
        if id(eqn) in skipped:
            return [None] * len(eqn.outvars)
        ring = rings.get(id(eqn))
        if ring is not None:
            op, c = ring
            out = _ring(ring_attention, op, c, mesh, plan.ring_orders[c.ring], [read(v) for v in op.operands])
            return [constrain(eqn.outvars[0], out)]
        outs = eqn.primitive.bind(*values, **eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        return [constrain(v, x) for v, x in zip(eqn.outvars, outs)]

    def flat(*args: Any) -> list:
        return evaluate(graph.jaxpr, graph.consts, args, on_eqn)

    return flat


def _ring(ring_attention: Callable, op: Any, c: Candidate, mesh: Any, order: tuple[int, ...], values: list) -> Any:
    a = op.attention
    q, k, v = (jax.numpy.transpose(x, p) for x, p in zip(values, (a.q_perm, a.k_perm, a.v_perm)))
    if len(a.batch) == 1:  # no heads: one head
        q, k, v = q[:, None], k[:, None], v[:, None]
    out = ring_attention(q, k, v, mesh=mesh, axis=c.ring, causal=a.causal, scale=a.scale, order=order,
                         batch_axis=c.axes[0])
    return out[:, 0] if len(a.batch) == 1 else out


def _on_slice(s: Any, plan: Plan, wrap: Callable, out_specs: Optional[list]) -> Callable:
    from pathways.client.compiled import abstract_mesh, jit
    from pathways.client.devices import VirtualMesh

    abstract = abstract_mesh(plan.mesh.shape, plan.mesh.axes)
    body = wrap(plan.jax_fun(abstract))
    in_specs = jax.tree.unflatten(plan.in_tree, plan.in_specs)
    outs = jax.tree.unflatten(plan.out_tree, out_specs) if out_specs is not None else None
    return jit(body, mesh=VirtualMesh(s, plan.mesh.shape, plan.mesh.axes), in_shardings=in_specs,
               out_shardings=outs)


# ---- figures --------------------------------------------------------------------------------


def _devices(devices: Any) -> tuple[Any, Optional[list]]:
    from pathways.client.devices import VirtualDevices

    if isinstance(devices, VirtualDevices):
        return devices.slice, None
    seq = list(devices) if isinstance(devices, (list, tuple)) else None
    if seq and all(isinstance(d, jax.Device) for d in seq):
        return None, seq
    raise SignatureError(f"conduct needs a slice's devices (slice.devices) or a list of JAX devices; got "
                         f"{type(devices).__name__}")


def _slice_figures(s: Any, topology: Any) -> Figures:
    from pathways.cluster import measured_topology

    if topology is None:
        topology = measured_topology(s.session.address, security=s.session.security)
    hosts = [w for w, _ in s._physical]

    def link(i: int, j: int) -> tuple[float, float]:
        if hosts[i] == hosts[j]:
            return pricing.SAME_HOST_LATENCY, pricing.SAME_HOST_BANDWIDTH
        found = topology.link(str(hosts[i]), str(hosts[j]))
        return found.latency, found.bandwidth

    return _figures_of(min(topology.device(str(w)).flops for w in set(hosts)), len(hosts), link)


def _jax_figures(devices: list, topology: Any) -> Figures:
    def link(i: int, j: int) -> tuple[float, float]:
        if topology is not None:
            found = topology.link(str(i), str(j))
            return found.latency, found.bandwidth
        if devices[i].process_index == devices[j].process_index:
            return pricing.SAME_HOST_LATENCY, pricing.SAME_HOST_BANDWIDTH
        return ASSUMED_LATENCY, ASSUMED_BANDWIDTH

    n = len(devices)
    flops = min(topology.device(str(i)).flops for i in range(n)) if topology is not None else ASSUMED_FLOPS
    return _figures_of(flops, n, link)


def _figures_of(flops: float, n: int, link: Callable[[int, int], tuple[float, float]]) -> Figures:
    """Figures for ``n`` devices, ``link(i, j)`` giving the (latency, bandwidth) from i to j."""
    latency, bandwidth = np.zeros((n, n)), np.full((n, n), math.inf)
    for i in range(n):
        for j in range(n):
            if i != j:
                latency[i, j], bandwidth[i, j] = link(i, j)
    return Figures(flops, latency, bandwidth)


def _ring_order(best_ring: Callable, figures: Figures, mesh: Mesh, axis: str) -> tuple[int, ...]:
    """The ring over ``axis``'s positions whose slowest hop is fastest, for the worst line along it."""
    lines = mesh.positions(axis)
    k = mesh.size(axis)
    lat = np.zeros((k, k))
    for line in lines:
        lat = np.maximum(lat, figures.latency[np.ix_(line, line)])
    return tuple(best_ring(lat.tolist()))


def _slowest_hop(figures: Figures, mesh: Mesh, axis: str, order: tuple[int, ...]) -> tuple[float, float]:
    worst_lat, worst_bw = 0.0, math.inf
    for line in mesh.positions(axis):
        for a, b in zip(order, order[1:] + order[:1]):
            worst_lat = max(worst_lat, float(figures.latency[line[a], line[b]]))
            worst_bw = min(worst_bw, float(figures.bandwidth[line[a], line[b]]))
    return worst_lat, worst_bw


# ---- the solver's input -----------------------------------------------------------------------


def _as_choice(c: Candidate) -> Any:
    from pathways.planner.sharding import Choice

    return Choice(c.label, c.seconds, c.resident_bytes, c.working_bytes)


def _incoming(graph: Graph) -> list[list[tuple[int, int]]]:
    """For each operation, the (producer, result index) of each operand."""
    return [[graph.producer[v] for v in op.operands] for op in graph.operations]


def _transfers(graph: Graph, cands: list[list[Candidate]], mesh: Mesh) -> list:
    from pathways.planner.sharding import Transfer

    out = []
    for dst, sources in enumerate(_incoming(graph)):
        op = graph.operations[dst]
        for j, (src, r) in enumerate(sources):
            nbytes = graph.value_bytes(op.operands[j])
            matrix = tuple(tuple(pricing.reshard_seconds(nbytes, a.result_specs[r], b.operand_specs[j], mesh)
                                 for b in cands[dst]) for a in cands[src])
            out.append(Transfer(src, dst, matrix))
    return out


def _aval(x: Any, i: int) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) of an argument leaf: an array of any kind, or a ``jax.ShapeDtypeStruct``."""
    from pathways.client.compiled import host_array

    if hasattr(x, "shape") and hasattr(x, "dtype"):
        # as jit types it: a float64 array is float32 unless the caller enabled 64-bit types
        return tuple(x.shape), np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    try:
        a = host_array(x)
    except TypeError as e:
        raise SignatureError(f"argument leaf {i} {e}") from None
    return a.shape, a.dtype


def _describe(avals: tuple) -> str:
    return ", ".join(f"{np.dtype(d).name}{list(s)}" for s, d in avals)


def _is_literal(v: Any) -> bool:
    from jax.extend.core import Literal

    return isinstance(v, Literal)


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f}"
