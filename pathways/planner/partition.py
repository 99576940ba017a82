"""Pipeline partitioning: which devices run a model's layers, in which ring order, and which
contiguous layer range each device runs.

Cost model (every strategy is scored with it, so plans compare on equal terms):

- A *stage* is one device running layers ``[start, end)``. Its compute time is the sum of
  its layers' ``flops`` divided by the device's ``flops``; its memory is the sum of its
  layers' ``param_bytes`` plus the largest ``activation_bytes`` among its layers (one
  layer's output is alive at a time).
- The link after stage ``i`` carries the activation of its last layer:
  ``topology.transfer_time(device_i, device_next, activation_bytes[end - 1])``. With two or
  more stages the stages form a ring: the last stage sends the last layer's output back to
  the first (the next token), and that return link is the last stage's outgoing link.
- ``"latency"``: seconds for one token (microbatch) around the ring = the sum of the stages'
  compute times and of every link between consecutive stages, return link included.
- ``"throughput"``: microbatches per second in steady state = 1 / the slowest stage, where a
  stage is as slow as the larger of its compute time and its outgoing link time (a link
  sends while the stage computes the next microbatch).

Strategies:

- ``"memory_weighted"`` is exo's ``RingMemoryWeightedPartitioningStrategy`` exactly
  (devices sorted by (memory, id) descending, each given ``memory / total memory`` of the
  model, ends rounded to 5 decimals) followed by exo's ``map_partitions_to_shards``. It
  ignores speeds and links, and it does not check memory: ``fits_memory`` says whether
  every stage fits its device.
- ``"optimal"`` is the exact optimum under memory limits (every stage fits its device),
  over which devices are used (a subset is allowed), their ring order and each one's
  layer range, found with OR-Tools CP-SAT. Two exact models: for small and mid-sized
  problems, a layer model (a Boolean per layer and device, and per layer boundary and
  ordered device pair, whose relaxation is a flow and proves optima fast); for large
  problems, a compact circuit model (a circuit over the devices chooses the used ones and
  their order, with integer layer boundaries and element constraints on prefix sums).
  The solver starts from the best of a few greedy plans and exo's plan when that fits, so
  it never returns worse than exo. Times are scaled to integers, one unit being 1e-8 of a
  lower bound on the optimum (coarser only when that would make the objective exceed
  2^36 units: CP-SAT's relaxation works in doubles); rounding moves a plan's value by at
  most about ``2 * devices`` units, so the plan returned is optimal to a relative
  ``~2e-8 * devices``, and its reported value is recomputed in floating point. Past the
  ``time_limit`` the best plan found comes back with ``optimal=False`` and a proven bound.
  Set ``PATHWAYS_PLAN_LOG=1`` to see CP-SAT's search log.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pathways import config
from pathways.planner import sat
from pathways.planner.topology import (PlanError, Topology, UnknownLinkError, _check_amount, _check_time_limit,
                                       _check_topology, _nonempty)

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

OBJECTIVES = ("latency", "throughput")
STRATEGIES = ("optimal", "memory_weighted")

# One integer time unit is this fraction of a lower bound on the optimum.
_RESOLUTION = 1e-8
# The largest objective value in integer units. CP-SAT's linear relaxation works in
# doubles; with values near 1e12 it was seen to prove wrong optima, near 1e10 it is sound.
_MAX_UNITS = 2.0 ** 36
# Model sizes (items x devices) up to which CP-SAT runs two workers, and past which it
# skips presolve.
_SMALL_CELLS = 64
_LARGE_CELLS = 3000
# Problems with at most this many (boundary, device pair) moves use the layer model,
# larger ones the more compact circuit model.
_LAYER_MODEL_ARCS = 5_000


@dataclass(frozen=True)
class Layer:
    """One model layer: its work, its weights and the size of its output."""

    flops: float
    param_bytes: int
    activation_bytes: int  # bytes of this layer's output


@dataclass(frozen=True)
class Partition:
    """exo's partition: ``node_id`` runs the fraction ``[start, end)`` of the layers."""

    node_id: str
    start: float
    end: float


@dataclass(frozen=True)
class Stage:
    """``device`` runs layers ``[start, end)``; its compute time and memory per the cost model,
    and ``send_s``, the time of its outgoing link (to the next stage; the last stage's goes
    back to the first; 0 for a single stage)."""

    device: str
    start: int
    end: int
    compute_s: float
    memory_bytes: int
    send_s: float = 0.0


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan and its predicted cost.

    ``bound`` is a proven bound on the objective: a lower bound on ``latency`` (seconds)
    for the latency objective, an upper bound on ``throughput`` (microbatches/s) for the
    throughput objective; it equals the value when ``optimal``.
    """

    stages: tuple[Stage, ...]
    partitions: tuple[Partition, ...]
    objective: str
    strategy: str
    latency: float
    throughput: float
    optimal: bool
    bound: float
    fits_memory: bool

    @property
    def value(self) -> float:
        """The objective's value: ``latency`` or ``throughput``."""
        return self.latency if self.objective == "latency" else self.throughput


def ring_memory_weighted_partitions(topology: Topology) -> tuple[Partition, ...]:
    """exo's ``RingMemoryWeightedPartitioningStrategy.partition``: every device, sorted by
    (memory, id) descending, gets a share of the model proportional to its memory."""
    nodes = sorted(topology.devices, key=lambda d: (d.memory_bytes, d.id), reverse=True)
    total_memory = sum(d.memory_bytes for d in nodes)
    partitions = []
    start: float = 0
    for d in nodes:
        end = round(start + (d.memory_bytes / total_memory), 5)
        partitions.append(Partition(d.id, start, end))
        start = end
    return tuple(partitions)


def partitions_to_layer_ranges(partitions: Sequence[Partition], num_layers: int) -> list[tuple[str, int, int]]:
    """exo's ``map_partitions_to_shards``: each partition's fractions become a layer range
    ``(node_id, start, end)`` (end exclusive; exo's shards name the inclusive last layer).

    The last partition always reaches the last layer, partitions that round to no layer are
    dropped, and the last range kept is stretched to the last layer if it falls short.
    """
    if num_layers < 1:
        raise PlanError(f"num_layers must be at least 1, got {num_layers}")
    ranges: list[tuple[str, int, int]] = []  # inclusive end_layer, as exo computes it
    for i, p in enumerate(partitions):
        start_layer = int(p.start * num_layers)
        end_layer = int(p.end * num_layers) - 1
        if i == len(partitions) - 1:
            end_layer = num_layers - 1
        if start_layer <= end_layer:
            ranges.append((p.node_id, start_layer, end_layer))
    if ranges and ranges[-1][2] < num_layers - 1:
        ranges[-1] = (ranges[-1][0], ranges[-1][1], num_layers - 1)
    return [(node, start, end + 1) for node, start, end in ranges]


def pipeline_partition(topology: Topology, layers: Sequence[Layer], objective: str = "latency",
                       strategy: str = "optimal", *, time_limit: float = 10.0) -> PipelinePlan:
    """Split ``layers`` over the devices of ``topology`` as a ring pipeline.

    ``objective`` is ``"latency"`` (seconds per token around the ring, minimized) or
    ``"throughput"`` (microbatches per second, maximized); ``strategy`` is ``"optimal"``
    (exact, under memory limits; may leave devices out) or ``"memory_weighted"`` (exo's
    strategy, for comparison). ``time_limit`` (seconds) bounds the optimal solve; past it
    the best plan found is returned with ``optimal=False``.
    """
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _check_time_limit(time_limit)
    model = _Model(topology, layers)
    if strategy == "memory_weighted":
        partitions = ring_memory_weighted_partitions(topology)
        ranges = partitions_to_layer_ranges(partitions, model.n)
        return model.plan(ranges, partitions, objective, strategy, optimal=False,
                          bound=model.trivial_bound(objective))
    return _optimal(model, objective, time_limit)


class _Model:
    """The validated inputs with their prefix sums and per-start memory tables."""

    def __init__(self, topology: Topology, layers: Sequence[Layer]) -> None:
        _check_topology(topology, "plan a pipeline")
        layers = _nonempty(layers, "layers", Layer, "a Layer", "a pipeline needs at least one layer")
        for i, layer in enumerate(layers):
            _check_amount(layer.flops, f"layers[{i}].flops")
            for name in ("param_bytes", "activation_bytes"):
                _check_amount(getattr(layer, name), f"layers[{i}].{name}", integer=True)
        self.topology = topology
        self.layers = layers
        self.n = len(layers)
        self.devices = topology.devices
        self.flops_prefix = [0.0]
        for layer in layers:
            self.flops_prefix.append(self.flops_prefix[-1] + layer.flops)
        if self.flops_prefix[-1] <= 0:
            raise PlanError("every layer has flops 0: give the layers their work so that plans can be compared")
        total_params = sum(layer.param_bytes for layer in layers)
        total_memory = sum(d.memory_bytes for d in self.devices)
        if total_params > total_memory:
            raise PlanError(f"the model cannot fit: its layers hold {total_params:,} parameter bytes but all "
                            f"{len(self.devices)} devices together have {total_memory:,} bytes; add devices "
                            "or memory, or shrink the model")
        # mem_rows[s][j]: memory of layers [s, s + 1 + j); non-decreasing in j.
        self.mem_rows: list[list[int]] = []
        for s in range(self.n):
            row, params, peak = [], 0, 0
            for layer in layers[s:]:
                params += layer.param_bytes
                peak = max(peak, layer.activation_bytes)
                row.append(params + peak)
            self.mem_rows.append(row)

    def memory(self, start: int, end: int) -> int:
        return self.mem_rows[start][end - start - 1]

    def max_end(self, memory_bytes: int) -> list[int]:
        """For each start (and ``n``), the furthest end whose range fits in ``memory_bytes``."""
        return [s + bisect.bisect_right(row, memory_bytes) for s, row in enumerate(self.mem_rows)] + [self.n]

    def compute_s(self, device: str, start: int, end: int) -> float:
        return (self.flops_prefix[end] - self.flops_prefix[start]) / self.topology.device(device).flops

    def trivial_bound(self, objective: str) -> float:
        """A bound every plan respects, memory aside: the fastest device alone for latency,
        all devices perfectly balanced (no links) for throughput."""
        total = self.flops_prefix[-1]
        if objective == "latency":
            return total / max(d.flops for d in self.devices)
        return sum(d.flops for d in self.devices) / total

    def plan(self, ranges: Sequence[tuple[str, int, int]], partitions: Sequence[Partition] | None,
             objective: str, strategy: str, *, optimal: bool, bound: float) -> PipelinePlan:
        """Score ``ranges`` (ring order) with the cost model."""
        links = self.link_times(ranges)
        stages = tuple(Stage(dev, s, e, self.compute_s(dev, s, e), self.memory(s, e), link)
                       for (dev, s, e), link in zip(ranges, links))
        latency = math.fsum(st.compute_s for st in stages) + math.fsum(links)
        period = max(max(st.compute_s, link) for st, link in zip(stages, links))
        throughput = 1.0 / period
        fits = all(st.memory_bytes <= self.topology.device(st.device).memory_bytes for st in stages)
        if partitions is None:
            partitions = tuple(Partition(dev, s / self.n, e / self.n) for dev, s, e in ranges)
        if optimal:
            bound = latency if objective == "latency" else throughput
        return PipelinePlan(stages, tuple(partitions), objective, strategy, latency, throughput, optimal,
                            bound, fits)

    def link_times(self, ranges: Sequence[tuple[str, int, int]]) -> list[float]:
        """Each stage's outgoing link time: to the next stage, the last one back to the first."""
        if len(ranges) < 2:
            return [0.0] * len(ranges)
        return [self.topology.transfer_time(dev, ranges[(i + 1) % len(ranges)][0],
                                            self.layers[e - 1].activation_bytes)
                for i, (dev, _, e) in enumerate(ranges)]

    def value(self, ranges: Sequence[tuple[str, int, int]], objective: str) -> float:
        """The objective to minimize: latency, or the slowest stage's period."""
        p = self.plan(ranges, (), objective, "", optimal=False, bound=0.0)
        return p.latency if objective == "latency" else 1.0 / p.throughput


def _wrap_up(time_limit: float) -> float:
    """Seconds of the time limit kept back from the solver: CP-SAT with several workers on a
    large model was seen to stop up to half a second after its own limit."""
    return min(0.6, 0.15 * time_limit)


def _cp_solver(seconds: float, cells: int, resolution: int = 0, workers: int | None = None) -> cp_model.CpSolver:
    """A CP-SAT solver for at most ``seconds`` on a model of ``cells`` (items x devices)
    whose integer objective is exact to ``resolution`` units.

    Small models get two workers (a single search strategy can stall where a second one
    does not), others eight: CP-SAT's portfolio is its strength even on few cores. Very
    large models skip presolve, which could otherwise spend the whole time limit before
    the search starts. The search stops once the gap between the best solution and the
    bound is within the resolution: closing it further would not make the plan better.
    """
    cp_model = sat.cp_model()

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, seconds)
    solver.parameters.absolute_gap_limit = float(resolution)
    solver.parameters.num_workers = workers or (2 if cells <= _SMALL_CELLS else 8)
    # OR-Tools 9.15's presolve can certify a wrong optimum through its inclusion detection
    # (seen on these very models: a feasible better plan declared impossible); this turns
    # that step off and leaves the rest of presolve on.
    solver.parameters.presolve_inclusion_work_limit = 0
    solver.parameters.cp_model_presolve = cells <= _LARGE_CELLS
    solver.parameters.log_search_progress = bool(config.PLAN_LOG.get())
    return solver


def _complete_hint(cp: cp_model.CpModel, fixes: Sequence[tuple[object, int]], seconds: float, cells: int) -> None:
    """Hint every variable of ``cp`` from a known solution given by its decisions.

    CP-SAT starts from a complete, feasible hint at once, but has to search to complete a
    partial one; a copy of the model with the decisions fixed solves by propagation alone,
    and its values become the hint. When the copy finds no solution within ``seconds``,
    the decisions alone are the hint.
    """
    cp_model = sat.cp_model()

    fixed = cp.clone()
    for var, value in fixes:
        fixed.add(fixed.get_int_var_from_proto_index(var.index) == int(value))
    solver = _cp_solver(seconds, cells, workers=1)
    status = solver.solve(fixed)
    cp.clear_hints()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for var, value in fixes:
            cp.add_hint(var, int(value))
        return
    for k in range(len(cp.proto.variables)):
        cp.add_hint(cp.get_int_var_from_proto_index(k), solver.value(fixed.get_int_var_from_proto_index(k)))


def _has_link(topology: Topology, a: str, b: str) -> bool:
    try:
        topology.link(a, b)
    except UnknownLinkError:
        return False
    return True


def _greedy_ranges(model: _Model, max_ends: dict[str, list[int]], objective: str) -> list[tuple[str, int, int]] | None:
    """A feasible plan to start the solver from, or None: the best of devices by speed each
    taking its speed's share of the work as far as memory allows (balanced, for throughput),
    devices by speed each taking all it can hold (few fast stages, for latency), devices
    by memory each taking all it can hold (the likeliest to fit), and exo's plan when it
    fits (so that the optimizer never returns worse than exo)."""
    n, total = model.n, model.flops_prefix[-1]
    by_speed = sorted(model.devices, key=lambda d: (-d.flops, d.id))
    by_memory = sorted(model.devices, key=lambda d: (-d.memory_bytes, d.id))
    speed_sum = sum(d.flops for d in model.devices)
    found = []
    for order, proportional in ((by_speed, True), (by_speed, False), (by_memory, False)):
        ranges: list[tuple[str, int, int]] = []
        start, share = 0, 0.0
        for d in order:
            if start == n:
                break
            end = max_ends[d.id][start]
            if proportional:
                share += d.flops / speed_sum * total
                want = bisect.bisect_left(model.flops_prefix, share - 1e-12 * total)
                end = min(end, max(want, start + 1))
            if end > start:
                if ranges and not _has_link(model.topology, ranges[-1][0], d.id):
                    continue
                ranges.append((d.id, start, end))
                start = end
        found.append(ranges if start == n else [])
    found.append(partitions_to_layer_ranges(ring_memory_weighted_partitions(model.topology), n))
    feasible = [r for r in found if r and _feasible(model, r)]
    return min(feasible, key=lambda r: model.value(r, objective), default=None)


def _feasible(model: _Model, ranges: Sequence[tuple[str, int, int]]) -> bool:
    """Whether every stage fits its device and every link of the ring exists."""
    if any(model.memory(s, e) > model.topology.device(dev).memory_bytes for dev, s, e in ranges):
        return False
    return len(ranges) < 2 or all(_has_link(model.topology, dev, ranges[(i + 1) % len(ranges)][0])
                                  for i, (dev, _, _) in enumerate(ranges))


def _optimal(model: _Model, objective: str, time_limit: float) -> PipelinePlan:
    began = time.monotonic()
    max_ends = {d.id: model.max_end(d.memory_bytes) for d in model.devices}
    if model.n == 1 or len(model.devices) == 1:
        # Only single-stage plans exist: try each device.
        options = [[(d.id, 0, model.n)] for d in model.devices if max_ends[d.id][0] == model.n]
        if not options:
            raise _no_fit(model)
        best = min(options, key=lambda r: (model.value(r, objective), r[0][0]))
        return model.plan(best, None, objective, "optimal", optimal=True, bound=0.0)
    cp_model = sat.cp_model()

    topo, n, devs = model.topology, model.n, model.devices
    m = len(devs)
    lower = model.trivial_bound(objective)
    if objective == "throughput":
        lower = 1.0 / lower
    links = {(a.id, b.id): topo.link(a.id, b.id) for a in devs for b in devs
             if a.id != b.id and _has_link(topo, a.id, b.id)}
    # One unit is _RESOLUTION of the lower bound, unless the objective could then pass
    # _MAX_UNITS: it never exceeds ``largest``, all the work on the slowest device plus the
    # slowest link after every stage (after one, for the throughput objective's period).
    biggest = max(layer.activation_bytes for layer in model.layers)
    slowest_link = max((lk.latency + biggest / lk.bandwidth for lk in links.values()), default=0.0)
    largest = (model.flops_prefix[-1] / min(d.flops for d in devs)
               + slowest_link * (m if objective == "latency" else 1))
    scale = min(1.0 / (_RESOLUTION * lower), _MAX_UNITS / largest)
    builder = _LayerModel if (n - 1) * m * m <= _LAYER_MODEL_ARCS else _CircuitModel
    built = builder(model, objective, lambda seconds: int(round(seconds * scale)), max_ends, links,
                    int(round(largest * scale)) + 2 * m + 1)

    budget = lambda: time_limit - (time.monotonic() - began)  # noqa: E731
    hint = _greedy_ranges(model, max_ends, objective)
    if hint is not None:
        _complete_hint(built.cp, built.fixes(hint), budget() / 4, m * n)
    solver = _cp_solver(budget() - _wrap_up(time_limit), m * n, built.slack)
    status = solver.solve(built.cp)
    if status == cp_model.INFEASIBLE:
        raise _no_fit(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise PlanError(f"no plan found within time_limit={time_limit} s; raise time_limit")
        found = hint
    else:
        found = built.read(solver)
        if hint is not None and model.value(hint, objective) < model.value(found, objective):
            found = hint
    lb_units = solver.best_objective_bound if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else 0.0
    lower_value = max(lower, (lb_units - built.slack) / scale)  # a lower bound on latency or period
    # Proven by the solver, or by reaching the bound (the fastest device alone, say).
    proven = status == cp_model.OPTIMAL or model.value(found, objective) <= lower_value * (1 + _RESOLUTION)
    bound = lower_value if objective == "latency" else 1.0 / lower_value
    return model.plan(found, None, objective, "optimal", optimal=proven, bound=bound)


class _LayerModel:
    """Each layer on one device; a boundary between layers k and k + 1 either stays on a
    device or moves from one device to another (a Boolean per ordered pair), so that layer
    by layer the assignment is a path whose linear relaxation is a flow, tight on the links.
    Each device is entered at most once (its layers are contiguous), the ring order is the
    order of the layers, and the return link is a pair (last device, first device).
    Size: about layers x devices^2 Booleans, for small and mid-sized problems."""

    def __init__(self, model: _Model, objective: str, units, max_ends, links, top: int) -> None:
        cp_model = sat.cp_model()

        self.model, self.devs = model, model.devices
        n, devs = model.n, model.devices
        cp = self.cp = cp_model.CpModel()
        acts = [layer.activation_bytes for layer in model.layers]
        params = [layer.param_bytes for layer in model.layers]
        # a[i, k]: layer k runs on device i (only where that layer alone fits).
        a = self.a = {(i, k): cp.new_bool_var(f"layer_{d.id}_{k}") for i, d in enumerate(devs)
                      for k in range(n) if max_ends[d.id][k] > k}
        for k in range(n):
            cp.add_exactly_one(a[i, k] for i in range(len(devs)) if (i, k) in a)
        pairs = [(i, j) for i, d in enumerate(devs) for j, e in enumerate(devs) if (d.id, e.id) in links]
        self.move: dict[tuple[int, int, int], object] = {}
        self.ret: dict[tuple[int, int], object] = {}
        out_cost: dict[int, list] = {i: [] for i in range(len(devs))}
        entered: dict[int, list] = {i: [a[i, 0]] if (i, 0) in a else [] for i in range(len(devs))}

        def send(i: int, j: int, nbytes: int) -> int:
            lk = links[devs[i].id, devs[j].id]
            return units(lk.latency) + units(nbytes / lk.bandwidth)

        for k in range(n - 1):
            leave: dict[int, list] = {}
            arrive: dict[int, list] = {}
            for i, j in pairs:
                if (i, k) in a and (j, k + 1) in a:
                    z = self.move[k, i, j] = cp.new_bool_var(f"move_{k}_{devs[i].id}_{devs[j].id}")
                    leave.setdefault(i, []).append(z)
                    arrive.setdefault(j, []).append(z)
                    entered[j].append(z)
                    out_cost[i].append(send(i, j, acts[k]) * z)
            for i in range(len(devs)):
                here, there = a.get((i, k)), a.get((i, k + 1))
                stay = cp.new_bool_var(f"stay_{k}_{devs[i].id}") if here is not None and there is not None else 0
                cp.add((here if here is not None else 0) == stay + sum(leave.get(i, [])))
                cp.add((there if there is not None else 0) == stay + sum(arrive.get(i, [])))
        for i in range(len(devs)):
            if len(entered[i]) > 1:
                cp.add_at_most_one(entered[i])
        # The return link: from the device of the last layer to that of the first, unless
        # one device runs every layer.
        last_on, first_on = {}, {}
        for i, j in pairs:
            if (i, n - 1) in a and (j, 0) in a:
                r = self.ret[i, j] = cp.new_bool_var(f"return_{devs[i].id}_{devs[j].id}")
                last_on.setdefault(i, []).append(r)
                first_on.setdefault(j, []).append(r)
                out_cost[i].append(send(i, j, acts[n - 1]) * r)
        for i in range(len(devs)):
            alone = cp.new_bool_var(f"alone_{devs[i].id}") if (i, 0) in a and (i, n - 1) in a else 0
            cp.add(a.get((i, n - 1), 0) == alone + sum(last_on.get(i, [])))
            cp.add(a.get((i, 0), 0) == alone + sum(first_on.get(i, [])))
        comps = []
        for i, d in enumerate(devs):
            mine = [k for k in range(n) if (i, k) in a]
            if not mine:
                comps.append(0)
                continue
            peak = cp.new_int_var(0, max(acts), f"peak_{d.id}")
            for k in mine:
                cp.add(peak >= acts[k] * a[i, k])
            if sum(params[k] for k in mine) + max(acts[k] for k in mine) > d.memory_bytes:
                cp.add(sum(params[k] * a[i, k] for k in mine) + peak <= d.memory_bytes)
            table = [units(p / d.flops) for p in model.flops_prefix]
            comps.append(sum((table[k + 1] - table[k]) * a[i, k] for k in mine))
        if objective == "latency":
            cp.minimize(sum(comps) + sum(sum(c) for c in out_cost.values()))
            self.slack = 2 * len(devs)
        else:
            period = cp.new_int_var(0, top, "period")
            for i in range(len(devs)):
                cp.add(period >= comps[i])
                cp.add(period >= sum(out_cost[i]))
            cp.minimize(period)
            self.slack = 1

    def fixes(self, ranges: Sequence[tuple[str, int, int]]) -> list:
        index = {d.id: i for i, d in enumerate(self.devs)}
        on = [0] * self.model.n
        for dev, s, e in ranges:
            for k in range(s, e):
                on[k] = index[dev]
        out = [(v, on[k] == i) for (i, k), v in self.a.items()]
        out += [(z, on[k] == i and on[k + 1] == j) for (k, i, j), z in self.move.items()]
        out += [(r, on[-1] == i and on[0] == j) for (i, j), r in self.ret.items()]
        return out

    def read(self, solver) -> list[tuple[str, int, int]]:
        on = {k: i for (i, k), v in self.a.items() if solver.boolean_value(v)}
        ranges: list[tuple[str, int, int]] = []
        for k in range(self.model.n):
            dev = self.devs[on[k]].id
            if ranges and ranges[-1][0] == dev:
                ranges[-1] = (dev, ranges[-1][1], k + 1)
            else:
                ranges.append((dev, k, k + 1))
        return ranges


class _CircuitModel:
    """A circuit over the devices and a depot chooses the used devices and their ring order
    (an unused device takes its self-loop); each device has integer layer boundaries, equal
    to its successor's; compute times are element constraints on per-device prefix sums,
    memory an element on the furthest end that fits from each start, and link times
    elements on the sending stage's end. Size: about devices^2 + devices x layers, for large
    problems."""

    def __init__(self, model: _Model, objective: str, units, max_ends, links, top: int) -> None:
        cp_model = sat.cp_model()

        self.model, self.devs = model, model.devices
        n, devs = model.n, model.devices
        acts = [layer.activation_bytes for layer in model.layers]
        cp = self.cp = cp_model.CpModel()
        starts = self.starts = [cp.new_int_var(0, n, f"start_{d.id}") for d in devs]
        ends = self.ends = [cp.new_int_var(0, n, f"end_{d.id}") for d in devs]
        used = self.used = [cp.new_bool_var(f"used_{d.id}") for d in devs]
        first = self.first = [cp.new_bool_var(f"first_{d.id}") for d in devs]
        last = self.last = [cp.new_bool_var(f"last_{d.id}") for d in devs]
        arcs: list[tuple[int, int, object]] = []
        follows = self.follows = {}
        for i, d in enumerate(devs):
            arcs += [(0, i + 1, first[i]), (i + 1, 0, last[i]), (i + 1, i + 1, ~used[i])]
            cp.add(starts[i] == 0).only_enforce_if(first[i])
            cp.add(ends[i] == n).only_enforce_if(last[i])
            cp.add(ends[i] >= starts[i] + 1).only_enforce_if(used[i])
            cp.add(starts[i] == 0).only_enforce_if(~used[i])
            cp.add(ends[i] == 0).only_enforce_if(~used[i])
            fit = cp.new_int_var(0, n, f"fit_{d.id}")
            cp.add_element(starts[i], max_ends[d.id], fit)
            cp.add(ends[i] <= fit)
            for j, e in enumerate(devs):
                if (d.id, e.id) in links:
                    follows[i, j] = x = cp.new_bool_var(f"arc_{d.id}_{e.id}")
                    arcs.append((i + 1, j + 1, x))
                    cp.add(starts[j] == ends[i]).only_enforce_if(x)
        cp.add_circuit(arcs)

        comps, outs = [], []
        for i, d in enumerate(devs):
            table = [units(p / d.flops) for p in model.flops_prefix]
            at_end = cp.new_int_var(0, table[-1], f"te_{d.id}")
            at_start = cp.new_int_var(0, table[-1], f"ts_{d.id}")
            cp.add_element(ends[i], table, at_end)
            cp.add_element(starts[i], table, at_start)
            comps.append(at_end - at_start)
            out = cp.new_int_var(0, top, f"link_{d.id}")  # the stage's outgoing link time
            outs.append(out)
            targets = [j for j, e in enumerate(devs) if (d.id, e.id) in links]
            send = _send_times(cp, d.id, ends[i], acts, {links[d.id, devs[j].id].bandwidth for j in targets},
                               units)
            for j in targets:
                lk = links[d.id, devs[j].id]
                need = units(lk.latency) + send[lk.bandwidth]
                cp.add(out >= need).only_enforce_if(follows[i, j])
                # The return link, when d is last and devs[j] first (two stages at least, as i != j).
                cp.add(out >= need).only_enforce_if([last[i], first[j]])
            for j in range(len(devs)):
                if j != i and j not in targets:
                    cp.add_bool_or([~last[i], ~first[j]])
        if objective == "latency":
            cp.minimize(sum(comps) + sum(outs))
            self.slack = 2 * len(devs)
        else:
            period = cp.new_int_var(0, top, "period")
            for c, out in zip(comps, outs):
                cp.add(period >= c)
                cp.add(period >= out)
            cp.minimize(period)
            self.slack = 1

    def fixes(self, ranges: Sequence[tuple[str, int, int]]) -> list:
        devs = self.devs
        where = {dev: (k, s, e) for k, (dev, s, e) in enumerate(ranges)}
        out = []
        for i, d in enumerate(devs):
            k, s, e = where.get(d.id, (-1, 0, 0))
            out += [(self.starts[i], s), (self.ends[i], e), (self.used[i], k >= 0), (self.first[i], k == 0),
                    (self.last[i], k == len(ranges) - 1)]
        order = [d for d, _, _ in ranges]
        nxt = {order[k]: order[k + 1] for k in range(len(order) - 1)}
        out += [(x, nxt.get(devs[i].id) == devs[j].id) for (i, j), x in self.follows.items()]
        return out

    def read(self, solver) -> list[tuple[str, int, int]]:
        succ = {i: j for (i, j), x in self.follows.items() if solver.boolean_value(x)}
        i = next(k for k in range(len(self.devs)) if solver.boolean_value(self.first[k]))
        ranges = []
        while True:
            ranges.append((self.devs[i].id, solver.value(self.starts[i]), solver.value(self.ends[i])))
            if i not in succ:
                return ranges
            i = succ[i]


def _send_times(cp, name: str, end, acts: Sequence[int], bandwidths: set[float], units) -> dict:
    """For each bandwidth, an expression of the time (units) to send the activation of the
    layer before ``end``: one element table per bandwidth, or, when the model has fewer
    distinct activation sizes than the device has bandwidths, one Boolean per size."""
    sizes = sorted(set(acts))
    if len(sizes) == 1:
        return {bw: units(sizes[0] / bw) for bw in bandwidths}
    if len(sizes) < len(bandwidths):
        which = cp.new_int_var(0, len(sizes) - 1, f"size_{name}")
        cp.add_element(end, [0] + [sizes.index(a) for a in acts], which)
        is_size = []
        for k in range(len(sizes)):
            b = cp.new_bool_var(f"size_{name}_{k}")
            cp.add(which == k).only_enforce_if(b)
            cp.add(which != k).only_enforce_if(~b)
            is_size.append(b)
        return {bw: sum(units(a / bw) * b for a, b in zip(sizes, is_size)) for bw in bandwidths}
    out = {}
    for k, bw in enumerate(sorted(bandwidths)):
        values = [0] + [units(a / bw) for a in acts]
        v = cp.new_int_var(0, max(values), f"send_{name}_{k}")
        cp.add_element(end, values, v)
        out[bw] = v
    return out


def _no_fit(model: _Model) -> PlanError:
    """The error for a model that no ring of linked devices can hold."""
    return PlanError(f"no assignment of the {model.n} layers fits the devices' memory (each device holds "
                     "its layers' parameters plus its largest activation) on a ring of linked devices; "
                     "add devices, memory or links, or shrink the model")
