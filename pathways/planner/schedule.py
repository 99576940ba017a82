"""Scheduling a task graph (DAG) on heterogeneous devices: which device runs each task, and when.

Constraints every schedule meets (``validate`` checks them):

- *dependencies*: a task starts after each predecessor ends plus the time to move the bytes
  the predecessor sends it, ``topology.transfer_time(device_u, device_v, nbytes)`` (nothing
  when both run on the same device);
- *memory*: the tasks placed on a device hold their ``memory_bytes`` for the whole
  schedule, and their sum fits the device's memory;
- *eligibility*: a task runs only on devices it has a duration for (``durations``, or any
  device when it gives ``flops``), restricted to ``eligible`` when given;
- *exclusivity*: a device runs one task at a time.

Methods:

- ``"heft"``: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri and Wu, 2002). Tasks
  are ranked by their upward rank, computed with each task's mean duration over its
  eligible devices and each edge's mean communication cost (mean latency plus bytes over
  mean bandwidth, over all pairs of distinct devices); in that order each task goes to the
  device where it finishes earliest, possibly in an idle gap between tasks already placed
  (insertion), among the eligible devices that still have memory for it. It is fast and
  greedy: it can fail to place a task when memory is tight although a placement exists.
- ``"optimal"``: minimum makespan with OR-Tools CP-SAT. One optional interval per (task,
  eligible device), exactly one present per task, no overlap per device, memory as a
  linear sum per device. Transfer times depend on both ends' devices; devices whose links
  to every other device are identical (the devices of one host or island, typically) are
  grouped into classes, so each dependency needs one constraint per class the successor
  may run on rather than one per pair of devices. Times are scaled to integers so that a
  unit is 1e-8 of an upper bound on the makespan; the schedule returned is re-timed in
  floating point from the solver's device assignment and per-device order, so rounding
  can cost at most about ``2 * tasks`` units, and the search stops once it is that close
  to its proven bound. CP-SAT starts from the HEFT schedule (and, when re-planning, from
  the previous schedule carried over), so it always has a solution; with a
  ``time_limit`` too short to prove optimality the best one found comes back with
  ``optimal=False`` and the proven ``lower_bound``.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pathways.planner.partition import _complete_hint, _cp_solver, _wrap_up
from pathways.planner import sat
from pathways.planner.topology import (Link, PlanError, Topology, UnknownLinkError, _check_amount,
                                       _check_time_limit, _check_topology)

METHODS = ("heft", "optimal")

# One integer time unit is this fraction of an upper bound on the makespan, which keeps
# every value near 1e8 (CP-SAT's linear relaxation works in doubles).
_RESOLUTION = 1e-8


@dataclass(frozen=True)
class Task:
    """A unit of work: how long it takes where, what it holds, and what it waits for.

    ``deps`` maps each predecessor's id to the bytes that predecessor sends to this task.
    """

    id: str
    durations: Mapping[str, float] | None = None  # seconds per device id; a device missing is not eligible
    flops: float | None = None  # when durations is None: duration = flops / device.flops
    memory_bytes: int = 0  # resident on its device for the whole schedule
    eligible: frozenset[str] | None = None  # None: every device that has a duration
    deps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """``task`` runs on ``device`` from ``start`` to ``end`` (seconds)."""

    task: str
    device: str
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    """A schedule, its makespan and a proven lower bound on the optimal makespan.

    ``tasks`` and ``topology`` are the problem it was made for (``schedule`` fills them
    in). Re-planning from this schedule uses them: when the new problem only restricts
    this one (tasks added, devices removed, nothing else loosened), its optimum cannot be
    below this one's ``lower_bound``, which then bounds the new search from below.
    """

    placements: Mapping[str, Placement]
    makespan: float
    lower_bound: float
    optimal: bool
    method: str
    solve_seconds: float
    tasks: tuple[Task, ...] = field(default=(), repr=False, compare=False)
    topology: Topology | None = field(default=None, repr=False, compare=False)


class _Problem:
    """Validated tasks: per-task eligible devices and durations, edges, a topological order."""

    def __init__(self, tasks: Sequence[Task], topology: Topology) -> None:
        _check_topology(topology, "schedule on")
        tasks = tuple(tasks)
        if not tasks:
            raise PlanError("tasks is empty: give at least one task to schedule")
        self.topology = topology
        self.devices = [d.id for d in topology.devices]
        self._links: dict[tuple[str, str], Link | None] | None = None
        self.tasks: dict[str, Task] = {}
        for i, t in enumerate(tasks):
            if not isinstance(t, Task):
                raise PlanError(f"tasks[{i}] must be a Task, got {type(t).__name__}")
            if not isinstance(t.id, str) or not t.id:
                raise PlanError(f"tasks[{i}].id must be a non-empty string, got {t.id!r}")
            if t.id in self.tasks:
                raise PlanError(f"task id {t.id!r} appears twice; give every task its own id")
            self.tasks[t.id] = t
        self.durations: dict[str, dict[str, float]] = {}
        for t in tasks:
            self.durations[t.id] = self._durations(t)
        self.preds: dict[str, dict[str, int]] = {}
        self.succs: dict[str, list[str]] = {t.id: [] for t in tasks}
        for t in tasks:
            if not isinstance(t.deps, Mapping):
                raise PlanError(f"task {t.id!r} deps must map predecessor ids to bytes, got {t.deps!r}")
            for p, nbytes in t.deps.items():
                if p not in self.tasks:
                    raise PlanError(f"task {t.id!r} depends on unknown task {p!r}; add it or remove the dependency")
                if p == t.id:
                    raise PlanError(f"task {t.id!r} depends on itself; remove that dependency")
                _check_amount(nbytes, f"task {t.id!r} dependency on {p!r}", integer=True, noun="a byte count")
                self.succs[p].append(t.id)
            self.preds[t.id] = dict(t.deps)
        self.order = self._topological_order()
        self.index = {t: k for k, t in enumerate(self.order)}
        self.edges = [(p, t, b) for t in self.order for p, b in self.preds[t].items()]

    def _durations(self, t: Task) -> dict[str, float]:
        topo = self.topology
        if t.durations is not None:
            if not isinstance(t.durations, Mapping):
                raise PlanError(f"task {t.id!r} durations must map device ids to seconds, got {t.durations!r}")
            out = {}
            for dev, seconds in t.durations.items():
                topo.device(dev)
                _check_amount(seconds, f"task {t.id!r} duration on {dev!r}")
                out[dev] = float(seconds)
        elif t.flops is not None:
            _check_amount(t.flops, f"task {t.id!r} flops")
            out = {d.id: t.flops / d.flops for d in topo.devices}
        else:
            raise PlanError(f"task {t.id!r} has neither durations nor flops; give one of them")
        if t.eligible is not None:
            for dev in t.eligible:
                topo.device(dev)
            out = {dev: s for dev, s in out.items() if dev in t.eligible}
        _check_amount(t.memory_bytes, f"task {t.id!r} memory_bytes", integer=True)
        roomy = {dev: s for dev, s in out.items() if topo.device(dev).memory_bytes >= t.memory_bytes}
        if not out:
            raise PlanError(f"task {t.id!r} has no eligible device: its durations and eligible set share no device")
        if not roomy:
            raise PlanError(f"task {t.id!r} needs {t.memory_bytes:,} bytes but none of its eligible devices "
                            f"{sorted(out)} has that much memory")
        # Keep the topology's device order so that ties break the same way every time.
        return {dev: roomy[dev] for dev in self.devices if dev in roomy}

    def _topological_order(self) -> list[str]:
        indegree = {t: len(self.preds[t]) for t in self.tasks}
        ready = [t for t in self.tasks if indegree[t] == 0]
        order = []
        while ready:
            t = ready.pop(0)
            order.append(t)
            for s in self.succs[t]:
                indegree[s] -= 1
                if indegree[s] == 0:
                    ready.append(s)
        if len(order) < len(self.tasks):
            raise PlanError(f"the task dependencies have a cycle: {' -> '.join(self._cycle(set(order)))}; "
                            "remove one of its dependencies")
        return order

    def _cycle(self, acyclic: set[str]) -> list[str]:
        """One dependency cycle among the tasks that are not in ``acyclic``."""
        t = next(t for t in self.tasks if t not in acyclic)
        path: list[str] = []
        while t not in path:
            path.append(t)
            t = next(p for p in self.preds[t] if p not in acyclic)
        cycle = path[path.index(t):] + [t]
        return cycle[::-1]  # predecessor first

    def link(self, a: str, b: str) -> Link | None:
        """The link between two distinct devices, or None where there is none (looked up once)."""
        if self._links is None:
            self._links = {}
            for x in self.devices:
                for y in self.devices:
                    if x != y:
                        try:
                            self._links[x, y] = self.topology.link(x, y)
                        except UnknownLinkError:
                            self._links[x, y] = None
        return self._links[a, b]

    def linked(self, a: str, b: str) -> bool:
        return a == b or self.link(a, b) is not None

    def comm(self, a: str, b: str, nbytes: int) -> float:
        """Seconds to move ``nbytes`` from device ``a`` to device ``b`` (linked)."""
        if a == b:
            return 0.0
        lk = self.link(a, b)
        return lk.latency + nbytes / lk.bandwidth

    def lower_bound(self) -> float:
        """A makespan no schedule beats: the longest dependency chain at each task's fastest
        duration without transfers, or all the work spread perfectly over every device."""
        fastest = {t: min(d.values()) for t, d in self.durations.items()}
        finish: dict[str, float] = {}
        for t in self.order:
            finish[t] = max((finish[p] for p in self.preds[t]), default=0.0) + fastest[t]
        return max(max(finish.values()), math.fsum(fastest.values()) / len(self.devices))

    def timeline(self, assign: Mapping[str, str], order_key: Mapping[str, float]) -> dict[str, Placement]:
        """Earliest start times given each task's device and each device's task order (by
        ``order_key``, ties by topological position): the schedule that assignment and order
        allow, computed in floating point."""
        return _retime(self, assign, order_key, lambda t, d: self.durations[t][d], self.comm)


def _retime(problem: _Problem, assign, order_key, duration, comm) -> dict:
    """Earliest start times of tasks on their assigned devices, each device running its tasks
    in ``order_key`` order; works with float or integer duration and comm functions."""
    per_device: dict[str, list[str]] = {}
    for t in sorted(problem.order, key=lambda t: (order_key[t], problem.index[t])):
        per_device.setdefault(assign[t], []).append(t)
    device_pred = {}
    for tasks in per_device.values():
        for a, b in zip(tasks, tasks[1:]):
            device_pred[b] = a
    # Kahn's order over dependency and device-order edges together.
    waiting = {t: len(problem.preds[t]) + (t in device_pred) for t in problem.order}
    device_succ = {a: b for b, a in device_pred.items()}
    ready = [(problem.index[t], t) for t in problem.order if waiting[t] == 0]
    heapq.heapify(ready)
    out: dict[str, Placement] = {}
    while ready:
        _, t = heapq.heappop(ready)
        d = assign[t]
        start = max([out[p].end + comm(assign[p], d, b) for p, b in problem.preds[t].items()]
                    + [out[device_pred[t]].end if t in device_pred else 0])
        out[t] = Placement(t, d, start, start + duration(t, d))
        for s in problem.succs[t] + ([device_succ[t]] if t in device_succ else []):
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (problem.index[s], s))
    if len(out) < len(problem.order):
        raise PlanError("the device order contradicts the task dependencies; order each device's tasks "
                        "consistently with them")
    return out


def schedule(tasks: Sequence[Task], topology: Topology, method: str = "heft", *, time_limit: float = 10.0,
             hint: Schedule | None = None) -> Schedule:
    """Schedule ``tasks`` on ``topology``'s devices to finish as early as possible.

    ``method`` is ``"heft"`` (greedy, fast) or ``"optimal"`` (CP-SAT, at most
    ``time_limit`` seconds). ``hint`` is a previous schedule of a slightly different
    problem (a task or device added or removed): the optimal solve starts from it carried
    over (tasks keep their devices and order where they still can), which bounds the
    search from above; when the new problem only restricts the old one (a task added, a
    device removed), the old proven lower bound also bounds it from below. Re-planning is
    faster than starting over, and exactly as optimal.
    """
    if method not in METHODS:
        raise PlanError(f"method must be one of {METHODS}, got {method!r}")
    _check_time_limit(time_limit)
    if hint is not None and not isinstance(hint, Schedule):
        raise PlanError(f"hint must be a Schedule (a previous plan), got {type(hint).__name__}")
    began = time.monotonic()
    problem = _Problem(tasks, topology)
    if method == "heft":
        placements = _heft(problem)
        makespan = max(p.end for p in placements.values())
        bound = problem.lower_bound()
        return Schedule(placements, makespan, min(bound, makespan), makespan <= bound * (1 + 1e-12), "heft",
                        time.monotonic() - began, tuple(tasks), topology)
    placements, lower, proven = _optimal(problem, time_limit, hint, began)
    return Schedule(placements, max(p.end for p in placements.values()), lower, proven, "optimal",
                    time.monotonic() - began, tuple(tasks), topology)


def _upward_ranks(problem: _Problem) -> dict[str, float]:
    devs = problem.devices
    pairs = [problem.link(a, b) for a in devs for b in devs if a != b and problem.linked(a, b)]
    mean_latency = math.fsum(lk.latency for lk in pairs) / len(pairs) if pairs else 0.0
    mean_bandwidth = math.fsum(lk.bandwidth for lk in pairs) / len(pairs) if pairs else math.inf
    rank: dict[str, float] = {}
    for t in reversed(problem.order):
        work = math.fsum(problem.durations[t].values()) / len(problem.durations[t])
        after = [rank[s] + (mean_latency + problem.preds[s][t] / mean_bandwidth if pairs else 0.0)
                 for s in problem.succs[t]]
        rank[t] = work + max(after, default=0.0)
    return rank


def _earliest_slot(busy: list[tuple[float, float]], ready: float, duration: float) -> float:
    """The earliest start >= ``ready`` of a ``duration`` gap among the sorted ``busy`` intervals."""
    start = ready
    for b_start, b_end in busy:
        if start + duration <= b_start:
            return start
        start = max(start, b_end)
    return start


def _list_schedule(problem: _Problem, order: Sequence[str],
                   fixed: Mapping[str, str] | None = None) -> dict[str, Placement]:
    """Place tasks in ``order`` (a topological order), each on the device where it finishes
    earliest (insertion into idle gaps allowed) among those with memory left; a task in
    ``fixed`` goes to its given device."""
    busy: dict[str, list[tuple[float, float]]] = {d: [] for d in problem.devices}
    memory_left = {d.id: d.memory_bytes for d in problem.topology.devices}
    out: dict[str, Placement] = {}
    for t in order:
        need = problem.tasks[t].memory_bytes
        candidates = [fixed[t]] if fixed and t in fixed else list(problem.durations[t])
        best: Placement | None = None
        for d in candidates:
            if memory_left[d] < need or not all(problem.linked(out[p].device, d) for p in problem.preds[t]):
                continue
            ready = max((out[p].end + problem.comm(out[p].device, d, b) for p, b in problem.preds[t].items()),
                        default=0.0)
            duration = problem.durations[t][d]
            start = _earliest_slot(busy[d], ready, duration)
            if best is None or start + duration < best.end:
                best = Placement(t, d, start, start + duration)
        if best is None:
            raise PlanError(f"HEFT could not place task {t!r}: none of its eligible devices "
                            f"{list(problem.durations[t])} has {need:,} bytes of memory left (or a link from "
                            "its predecessors' devices); use method='optimal', which places memory exactly")
        out[t] = best
        memory_left[best.device] -= need
        busy[best.device].append((best.start, best.end))
        busy[best.device].sort()
    return out


def _heft(problem: _Problem) -> dict[str, Placement]:
    rank = _upward_ranks(problem)
    order = sorted(problem.order, key=lambda t: (-rank[t], problem.index[t]))
    return _list_schedule(problem, order)


def _carry_over(problem: _Problem, previous: Schedule) -> dict[str, Placement] | None:
    """The previous schedule adapted to this problem: tasks that still exist keep their device
    when it is still eligible and has memory for them, in their previous order; the others are
    placed where they finish earliest. None when that greedy placement fails."""
    kept: dict[str, str] = {}
    memory_left = {d.id: d.memory_bytes for d in problem.topology.devices}
    old = {t: p for t, p in previous.placements.items() if t in problem.tasks}
    for t in sorted(old, key=lambda t: (old[t].start, problem.index[t])):
        d = old[t].device
        if d in problem.durations[t] and memory_left[d] >= problem.tasks[t].memory_bytes:
            kept[t] = d
            memory_left[d] -= problem.tasks[t].memory_bytes
    # A topological order that follows the previous start times; a new task comes as late
    # as its successors allow, so that it fills a gap rather than pushes the others back.
    key: dict[str, float] = {}
    for t in reversed(problem.order):
        key[t] = old[t].start if t in old else min((key[s] for s in problem.succs[t]), default=math.inf)
    waiting = {t: len(problem.preds[t]) for t in problem.order}
    ready = [(key[t], problem.index[t], t) for t in problem.order if not waiting[t]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, t = heapq.heappop(ready)
        order.append(t)
        for s in problem.succs[t]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, (key[s], problem.index[s], s))
    try:
        return _list_schedule(problem, order, kept)
    except PlanError:
        return None


def _restricts(problem: _Problem, previous: Schedule) -> bool:
    """Whether ``problem`` only restricts the one ``previous`` was made for: every schedule of
    ``problem``, less its new tasks, is a schedule of the old problem (the same devices or
    fewer, with the same links and no more memory; the old tasks with the same durations
    on the same devices or fewer, no less memory and at least their old dependencies)."""
    if previous.topology is None or not previous.tasks:
        return False
    try:
        old = _Problem(previous.tasks, previous.topology)
    except PlanError:
        return False
    new_topo, old_topo = problem.topology, old.topology
    old_devices = {d.id: d for d in old_topo.devices}
    for d in new_topo.devices:
        if d.id not in old_devices or d.memory_bytes > old_devices[d.id].memory_bytes:
            return False
    for a in problem.devices:
        for b in problem.devices:
            if a != b and problem.linked(a, b) and (not old.linked(a, b) or new_topo.link(a, b) != old_topo.link(a, b)):
                return False
    for t in old.order:
        if t not in problem.tasks or problem.tasks[t].memory_bytes < old.tasks[t].memory_bytes:
            return False
        if any(old.durations[t].get(d) != seconds for d, seconds in problem.durations[t].items()):
            return False
        if any(problem.preds[t].get(p, -1) < nbytes for p, nbytes in old.preds[t].items()):
            return False
    return True


def _link_classes(problem: _Problem) -> list[list[str]]:
    """Devices grouped so that, within a class, every device has the same links to every
    device outside the pair compared (so a transfer's time depends only on the classes of
    its two ends, and on whether they are the same device)."""
    devs = problem.devices
    table = {(a, b): problem.link(a, b) for a in devs for b in devs if a != b}  # Link or None

    def same(a: str, b: str) -> bool:
        if table[a, b] != table[b, a]:
            return False
        return all(table[a, c] == table[b, c] and table[c, a] == table[c, b] for c in devs if c not in (a, b))

    classes: list[list[str]] = []
    for d in devs:
        for c in classes:
            if all(same(d, member) for member in c):
                c.append(d)
                break
        else:
            classes.append([d])
    return classes


def _optimal(problem: _Problem, time_limit: float, previous: Schedule | None,
             began: float) -> tuple[dict[str, Placement], float, bool]:
    """The best schedule found, a proven lower bound on the optimum, and whether it is optimal."""
    best_known = _starting_point(problem, previous)
    upper = _serial_span(problem)
    if best_known is not None:
        upper = min(upper, max(p.end for p in best_known.values()))
    scale = 1.0 / (_RESOLUTION * upper) if upper > 0 else 1.0  # upper 0: no task takes time
    # Rounding moves a schedule's makespan by at most half a unit per duration and transfer
    # on its critical path: the integer optimum is within the horizon.
    n_terms = len(problem.order)
    model = _TimedModel(problem, scale, round(upper * scale) + 2 * n_terms + 2)
    model.add_transfers()
    # What no schedule beats: the dependency chains and the total work, and the previous
    # schedule's proven bound when this problem only restricts that one. A float bound L
    # allows no integer makespan below L * scale - n_terms (rounding again).
    floor = problem.lower_bound()
    if previous is not None and _restricts(problem, previous):
        floor = max(floor, previous.lower_bound)
    model.minimize_makespan(max(0, math.floor(floor * scale) - n_terms))
    return model.solve(best_known, time_limit, began, floor)


def _starting_point(problem: _Problem, previous: Schedule | None) -> dict[str, Placement] | None:
    """The better of HEFT's schedule and the previous one carried over (None: neither fits)."""
    starts_from = []
    try:
        starts_from.append(_heft(problem))
    except PlanError:
        pass
    if previous is not None:
        carried = _carry_over(problem, previous)
        if carried is not None:
            starts_from.append(carried)
    return min(starts_from, key=lambda pl: max(p.end for p in pl.values()), default=None)


def _serial_span(problem: _Problem) -> float:
    """Running the tasks one at a time in topological order, each after the slowest transfer
    of its inputs, is a schedule for any feasible assignment: no optimum ends later."""
    dur, preds = problem.durations, problem.preds
    pairs = [problem.link(a, b) for a in problem.devices for b in problem.devices
             if a != b and problem.linked(a, b)]
    worst_latency = max((lk.latency for lk in pairs), default=0.0)
    worst_bandwidth = min((lk.bandwidth for lk in pairs), default=math.inf)
    return math.fsum(max(dur[t].values()) + max((worst_latency + b / worst_bandwidth for b in preds[t].values()),
                                                default=0.0) for t in problem.order)


class _TimedModel:
    """The CP-SAT model of ``problem`` in integer time units (``scale`` per second, up to
    ``horizon``): each task's start and end, a Boolean per (task, eligible device) saying it
    runs there, the tasks of a device never overlapping and within its memory."""

    def __init__(self, problem: _Problem, scale: float, horizon: int) -> None:
        self.cp_model = sat.cp_model()
        self.problem, self.scale, self.horizon = problem, scale, horizon
        order, dur = problem.order, problem.durations
        cp = self.cp = self.cp_model.CpModel()
        self.start = {t: cp.new_int_var(0, horizon, f"start_{t}") for t in order}
        self.end = {t: cp.new_int_var(0, horizon, f"end_{t}") for t in order}
        self.x: dict[tuple[str, str], object] = {}
        self.device_of = {}  # task -> the position of its device (an integer expression)
        on_device: dict[str, list[object]] = {d: [] for d in problem.devices}
        position = {d: k for k, d in enumerate(problem.devices)}
        for t in order:
            for d, seconds in dur[t].items():
                self.x[t, d] = cp.new_bool_var(f"on_{t}_{d}")
                on_device[d].append(cp.new_optional_fixed_size_interval_var(
                    self.start[t], self.units(seconds), self.x[t, d], f"run_{t}_{d}"))
            cp.add_exactly_one(self.x[t, d] for d in dur[t])
            cp.add(self.end[t] == self.start[t] + sum(self.units(s) * self.x[t, d] for d, s in dur[t].items()))
            self.device_of[t] = sum(position[d] * self.x[t, d] for d in dur[t])
        for d, intervals in on_device.items():
            if len(intervals) > 1:
                cp.add_no_overlap(intervals)
            tasks_here = [t for t in order if d in dur[t]]
            memory = problem.topology.device(d).memory_bytes
            if sum(problem.tasks[t].memory_bytes for t in tasks_here) > memory:
                cp.add(sum(problem.tasks[t].memory_bytes * self.x[t, d] for t in tasks_here) <= memory)

    def units(self, seconds: float) -> int:
        return int(round(seconds * self.scale))

    def _in_classes(self) -> tuple[dict, dict[tuple[int, int], Link | str | None], dict[str, list[int]]]:
        """Devices grouped into classes whose links are all alike: for each (task, class) the
        Boolean saying the task runs there, the link between any two distinct devices of two
        classes ("same device" for a one-device class to itself; None where there is none),
        and each task's classes."""
        problem, cp, dur = self.problem, self.cp, self.problem.durations
        classes = _link_classes(problem)
        class_of = {d: k for k, members in enumerate(classes) for d in members}
        between: dict[tuple[int, int], Link | str | None] = {}
        for ku, mu in enumerate(classes):
            for kv, mv in enumerate(classes):
                if ku != kv:
                    between[ku, kv] = problem.link(mu[0], mv[0])
                else:
                    between[ku, kv] = problem.link(mu[0], mu[1]) if len(mu) > 1 else "same device"
        in_class: dict[tuple[str, int], object] = {}
        for t in problem.order:
            for k in sorted({class_of[d] for d in dur[t]}):
                members = [self.x[t, d] for d in classes[k] if d in dur[t]]
                if len(members) == 1:
                    in_class[t, k] = members[0]
                else:
                    in_class[t, k] = cp.new_bool_var(f"class_{t}_{k}")
                    cp.add(in_class[t, k] == sum(members))
        task_classes = {t: [k for k in range(len(classes)) if (t, k) in in_class] for t in problem.order}
        return in_class, between, task_classes

    def add_transfers(self) -> None:
        """Each edge's consumer starts after its producer ends, plus the transfer between the
        classes of their devices (none on the same device); no link: not on those two."""
        problem, cp, dur = self.problem, self.cp, self.problem.durations
        in_class, between, task_classes = self._in_classes()
        for u, v, nbytes in problem.edges:
            cp.add(self.start[v] >= self.end[u])
            same = None
            if set(dur[u]) & set(dur[v]):
                same = cp.new_bool_var(f"same_{u}_{v}")
                cp.add(self.device_of[u] == self.device_of[v]).only_enforce_if(same)
            for kv in task_classes[v]:
                y = in_class[v, kv]
                terms = []
                for ku in task_classes[u]:
                    g, lk = in_class[u, ku], between[ku, kv]
                    if isinstance(lk, str):  # both on the one device of this class
                        continue
                    if lk is None:  # no link: u must run elsewhere, or on v's very device
                        if ku == kv and same is not None:
                            cp.add_implication(g, same).only_enforce_if(y)
                        else:
                            cp.add_bool_or([~y, ~g])
                        continue
                    c = self.units(lk.latency + nbytes / lk.bandwidth)
                    terms.append(c * g)
                    if ku == kv and same is not None:
                        terms.append(-c * same)  # on the same device: no transfer
                if terms:
                    cp.add(self.start[v] >= self.end[u] + sum(terms)).only_enforce_if(y)

    def minimize_makespan(self, least: int) -> None:
        """Minimize the last end, known to be at least ``least`` units."""
        problem, cp, dur = self.problem, self.cp, self.problem.durations
        self.makespan = cp.new_int_var(min(least, self.horizon), self.horizon, "makespan")
        for t in problem.order:
            cp.add(self.makespan >= self.end[t])
        # Redundant, for the linear relaxation: a device is busy at most the makespan.
        for d in problem.devices:
            work = [self.units(dur[t][d]) * self.x[t, d] for t in problem.order if d in dur[t]]
            if len(work) > 1:
                cp.add(sum(work) <= self.makespan)
        cp.minimize(self.makespan)

    def solve(self, best_known: dict[str, Placement] | None, time_limit: float, began: float,
              floor: float) -> tuple[dict[str, Placement], float, bool]:
        """Solve from ``best_known`` (as a hint) within what is left of ``time_limit``; the best
        schedule (``best_known`` where the solver found none better), a lower bound on the
        optimum (at least ``floor``), and whether the schedule is optimal."""
        problem, cp_model, order, dur = self.problem, self.cp_model, self.problem.order, self.problem.durations
        n_terms = len(order)
        remaining = lambda: time_limit - (time.monotonic() - began)  # noqa: E731
        if best_known is not None:
            assign = {t: p.device for t, p in best_known.items()}
            key = {t: p.start for t, p in best_known.items()}
            timed = _retime(problem, assign, key, lambda t, d: self.units(dur[t][d]),
                            lambda a, b, nbytes: self.units(problem.comm(a, b, nbytes)))
            fixes = [(self.x[t, d], assign[t] == d) for t, d in self.x] + [(self.start[t], timed[t].start)
                                                                           for t in order]
            _complete_hint(self.cp, fixes, remaining() / 4, len(self.x))
        solver = _cp_solver(remaining() - _wrap_up(time_limit), len(self.x), 2 * n_terms + 2)
        status = solver.solve(self.cp)
        if status == cp_model.INFEASIBLE:
            raise PlanError("no schedule fits the devices' memory: the tasks' memory_bytes cannot be packed onto "
                            "their eligible devices; add devices or memory, or shrink the tasks")
        found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        if not found:
            if best_known is None:
                raise PlanError(f"no schedule found within time_limit={time_limit} s; raise time_limit")
            placements = best_known
        else:
            assign = {t: d for (t, d), var in self.x.items() if solver.boolean_value(var)}
            placements = problem.timeline(assign, {t: solver.value(self.start[t]) for t in order})
            if (best_known is not None
                    and max(p.end for p in best_known.values()) < max(p.end for p in placements.values())):
                placements = best_known
        span = max(p.end for p in placements.values())
        bound_units = solver.best_objective_bound if found else 0.0
        # Rounding can make the integer optimum up to n_terms units below the true one.
        lower = min(span, max(floor, (bound_units - n_terms) / self.scale))
        return placements, lower, status == cp_model.OPTIMAL or span <= lower * (1 + _RESOLUTION)


def validate(schedule: Schedule, tasks: Sequence[Task], topology: Topology) -> None:
    """Check ``schedule`` against every constraint of the problem; raise ``ValueError``
    (``PlanError``) naming the first one violated."""
    problem = _Problem(tasks, topology)
    placements = schedule.placements
    for t in problem.order:
        if t not in placements:
            raise PlanError(f"coverage violated: task {t!r} has no placement")
    for t in placements:
        if t not in problem.tasks:
            raise PlanError(f"coverage violated: the schedule places unknown task {t!r}")
    span = max(p.end for p in placements.values())
    tol = 1e-9 * max(span, 1e-9)
    for t in problem.order:
        p = placements[t]
        if p.task != t:
            raise PlanError(f"placement of task {t!r} names task {p.task!r}")
        if p.device not in problem.durations[t]:
            raise PlanError(f"eligibility violated: task {t!r} is placed on {p.device!r}, which is not among its "
                            f"eligible devices {list(problem.durations[t])}")
        if p.start < -tol:
            raise PlanError(f"start violated: task {t!r} starts at {p.start} < 0")
        want = problem.durations[t][p.device]
        if abs((p.end - p.start) - want) > tol:
            raise PlanError(f"duration violated: task {t!r} runs {p.end - p.start} s on {p.device!r}, "
                            f"its duration there is {want} s")
    for u, v, nbytes in problem.edges:
        pu, pv = placements[u], placements[v]
        if not problem.linked(pu.device, pv.device):
            raise PlanError(f"dependency violated: no link carries {u!r}'s output from {pu.device!r} to "
                            f"{pv.device!r}")
        ready = pu.end + problem.comm(pu.device, pv.device, nbytes)
        if pv.start < ready - tol:
            raise PlanError(f"dependency violated: task {v!r} starts at {pv.start} before {u!r}'s output arrives "
                            f"at {ready} (end {pu.end} plus transfer)")
    by_device: dict[str, list[Placement]] = {}
    for p in placements.values():
        by_device.setdefault(p.device, []).append(p)
    for d, ps in by_device.items():
        running: Placement | None = None  # the task that ends last among those started so far
        for p in sorted(ps, key=lambda p: (p.start, p.end)):
            if p.end <= p.start:
                continue  # an instantaneous task occupies no time
            if running is not None and p.start < running.end - tol:
                raise PlanError(f"exclusivity violated: tasks {running.task!r} and {p.task!r} overlap on {d!r}")
            if running is None or p.end > running.end:
                running = p
        used = sum(problem.tasks[p.task].memory_bytes for p in ps)
        if used > topology.device(d).memory_bytes:
            raise PlanError(f"memory violated: tasks on {d!r} hold {used:,} bytes, more than its "
                            f"{topology.device(d).memory_bytes:,}")
    if abs(schedule.makespan - span) > tol:
        raise PlanError(f"makespan violated: the schedule says {schedule.makespan} but its last task ends at {span}")
    if schedule.lower_bound > schedule.makespan + tol:
        raise PlanError(f"lower bound violated: {schedule.lower_bound} exceeds the makespan {schedule.makespan}")
