"""Sharding choice: one way ("choice") to run each operation of a graph, for the least total
time under a per-device memory limit.

Problem. Each ``Operation`` has candidate ``Choice``s, each with its own time (compute plus
its own collectives) and memory; each ``Transfer`` carries data from one operation to
another, and its resharding time depends on both ends' choices. A plan picks one choice per
operation; its time is the sum of the chosen choices' ``seconds`` and of every transfer's
``seconds`` for the chosen pair. The direction of a transfer does not matter to the solver.

Memory model: a device keeps every operation's ``resident_bytes`` (arguments, parameters,
outputs of the function) for the whole call and runs one operation at a time, so its peak is

    sum over operations of the chosen ``resident_bytes`` + the largest chosen ``working_bytes``

(``plan_peak_bytes``, rounded once). ``memory_limit`` bounds that peak. When no plan fits, a
``PlanError`` names the smallest peak any plan reaches (found exactly: for each cap on the
working bytes, each operation takes its least resident choice under the cap).

Method (``solve_sharding``):

- Presolve, repeated until nothing changes: choices that cannot fit the memory limit even
  with every other operation at its least memory are dropped; an operation left with one
  choice becomes a constant, and its transfers become costs of the other end's choices;
  parallel transfers are summed; every transfer is reparametrized (each row's, then each
  column's, minimum moves into the choices' own costs), so that one which only depends on
  one end, or on each end separately, disappears; a choice is dropped when another is at
  least as good whatever the neighbours choose (its own seconds plus, per transfer, the
  largest difference over the neighbour's choices) and, while the limit can bind, holds
  no more resident and working bytes. Identical choices are merged that way too. Once every
  plan fits, the limit is dropped.
- While the limit can bind, the problem without it is solved first (it presolves further
  and solves faster): its optimum, when it fits, is the answer; otherwise it bounds the
  optimum and is one of the starting plans below.
- No memory limit left and the remaining graph a forest: dynamic programming, exact
  (``method="dp"``).
- Otherwise OR-Tools CP-SAT (``method="cp-sat"``): a Boolean per (operation, choice), and
  per transfer the marginal formulation: a Boolean per pair of (group of identical rows,
  group of identical columns) of its cost matrix, whose sums over a row group and over a
  column group are the two ends' choices; its linear relaxation is exact on trees and tight
  on chains with a few extra edges. The largest working bytes is a staircase of Booleans,
  one per distinct value, each implied by every operation's choices at or above it. The
  search starts, as a complete hint, from the cheapest of a few plans polished by local
  search: the previous plan ``hint``, the optimum over a spanning forest and, under a
  memory limit, the optimum without it, the smallest-peak plan and plans found by pricing
  memory (a Lagrangian relaxation of the limit), each repaired to fit. The optimum over the
  spanning forest also bounds the optimum from below (every transfer costs at least zero
  once reparametrized): a starting plan that meets the bound is returned as proven optimal
  without a search, and a ``time_limit`` too short to build the model and then search as
  long (about 25 us per entry of the transfer matrices left) returns the best starting
  plan with that bound (``optimal=False`` unless it meets it).

Exactness. Times are scaled to integers, one unit being 2^-36 of the starting plan's cost
above the constant every plan pays (CP-SAT's linear relaxation works in doubles); a positive
cost is at least one unit, so a plan of cost zero is recognised exactly. With ``T``
operations and transfers left after presolve, rounding moves a plan's value by less than
``T`` units, and the solver's optimum costs less than ``1.5 * T`` units more than the true
optimum. When that margin exceeds 1e-9 of the plan's seconds and the plan costs less than
half the starting plan above the constant, the problem is solved again with units scaled
to the plan. Among the solver's plans and the starting plan, the one returned is the
cheapest recomputed in floating point. So the plan returned is optimal to within
``max(1e-9, 3 * T * 2^-36) * seconds``: 1e-9 up to 22 operations and transfers, 1.5e-8 in
the worst case for 150 operations and 197 transfers, closer in practice as the starting plan
is rarely far from the optimum and rounding errors cancel.

Memory is scaled to integers by a power of two, so that the largest possible peak is about
2^30 units (integer byte counts stay exact while that largest peak is under 2^30 bytes).
The solver's model rounds down (it admits every plan that fits), the local search rounds up
(what it finds fits); an optimum of the model that exceeds the limit in bytes (rounding
admitted it) is excluded and the model solved again, so the plan returned fits and the
limit costs no optimality. Past ``time_limit`` the best plan found comes back with
``optimal=False`` and a proven bound. Set ``PATHWAYS_PLAN_LOG=1`` to see CP-SAT's search log.

``exhaustive_sharding`` enumerates every plan, for checking small problems.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pathways.planner.partition import _MAX_UNITS, _cp_solver, _wrap_up
from pathways.planner import sat
from pathways.planner.topology import PlanError, _check_amount, _check_time_limit

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

METHODS = ("dp", "cp-sat", "exhaustive")

# The relative accuracy the integer scaling aims for; see "Exactness" above.
_TOLERANCE = 1e-9
# Memory is scaled by a power of two so that the largest possible peak is at most this many
# units: fine enough that rounding rarely matters (see _search), small enough for the
# solver's relaxation, which works in doubles.
_MEMORY_UNITS = 2.0 ** 30
# exhaustive_sharding refuses problems with more plans than this.
_EXHAUSTIVE_PLANS = 2_000_000
# Rounds of local search polishing a starting plan.
_POLISH_ROUNDS = 30
# Prices of memory tried for starting plans under a memory limit.
_PRICE_ROUNDS = 8
# Solver optima excluded for exceeding the memory limit by less than the rounding, at most.
_EXCLUDED_PLANS = 20
# Building the CP-SAT model takes about this long per entry of the transfer matrices left
# after presolve (measured on a 2-core machine): a solve without time left for at least as
# long a search after building does not start.
_BUILD_SECONDS_PER_ENTRY = 2.5e-5


@dataclass(frozen=True)
class Choice:
    """One way to run an operation."""

    label: str
    seconds: float  # its compute plus its own collectives (e.g. an all-reduce of partial sums)
    resident_bytes: float  # per-device bytes it keeps for the whole call (arguments, parameters, outputs)
    working_bytes: float  # per-device bytes live while it runs (its inputs, output and temporaries)


@dataclass(frozen=True)
class Operation:
    """An operation of the graph and its candidate choices (at least one)."""

    name: str
    choices: tuple[Choice, ...]


@dataclass(frozen=True)
class Transfer:
    """Data from operation ``src`` to operation ``dst``; ``seconds[i][j]`` is the resharding
    time when ``src`` takes its choice ``i`` and ``dst`` its choice ``j``."""

    src: int
    dst: int
    seconds: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ShardingSolution:
    """A plan: ``choices[i]`` indexes ``operations[i].choices``.

    ``seconds`` and ``peak_bytes`` are recomputed in floating point from the inputs
    (``plan_seconds``, ``plan_peak_bytes``); ``bound`` is a proven lower bound on the
    optimal seconds, equal to ``seconds`` when ``optimal``; ``method`` is one of ``METHODS``.
    """

    choices: tuple[int, ...]
    seconds: float
    peak_bytes: float
    optimal: bool
    bound: float
    solve_seconds: float
    method: str


def plan_seconds(operations: Sequence[Operation], transfers: Sequence[Transfer], choices: Sequence[int]) -> float:
    """The time of a plan: its choices' seconds plus every transfer's seconds for the chosen pair."""
    operations, transfers = _validate(operations, transfers)
    return _seconds(operations, transfers, _check_plan(choices, operations, "choices"))


def plan_peak_bytes(operations: Sequence[Operation], choices: Sequence[int]) -> float:
    """The peak bytes per device of a plan: its resident bytes plus its largest working bytes."""
    operations, _ = _validate(operations, ())
    return _peak(operations, _check_plan(choices, operations, "choices"))


def solve_sharding(operations: Sequence[Operation], transfers: Sequence[Transfer], *,
                   memory_limit: float | None = None, time_limit: float = 30.0,
                   hint: Sequence[int] | None = None) -> ShardingSolution:
    """The plan of least ``plan_seconds`` whose ``plan_peak_bytes`` is at most
    ``memory_limit`` (any peak when None).

    ``hint`` is a previous plan (one choice index per operation), for example from before a
    small change of the problem: the search starts from it, so re-planning is fast.
    ``time_limit`` (seconds) bounds the solve; past it the best plan found comes back with
    ``optimal=False``. Raises ``PlanError`` for invalid inputs and when no plan fits.
    """
    began = time.monotonic()
    _check_time_limit(time_limit)
    operations, transfers = _validate(operations, transfers, memory_limit)
    starts = []
    if hint is not None:
        starts.append(_check_plan(hint, operations, "hint"))
    if memory_limit is not None:
        least, smallest = _least_peak(operations)
        if least > memory_limit:
            raise _no_fit(memory_limit, least)
    problem = _Reduced(operations, transfers, memory_limit)
    lower = 0.0
    if problem.limit_units is not None:
        # The problem without the limit first (it presolves further and solves faster): its
        # optimum, when it fits, is the answer; otherwise it bounds the optimum and, repaired
        # to fit, starts the search.
        free = _optimum(_Reduced(operations, transfers, None), starts, began, began + time_limit / 3, time_limit)
        if free.optimal and free.peak_bytes <= memory_limit:
            return free
        starts += [free.choices, smallest]
        lower = free.bound
    return _optimum(problem, starts, began, began + time_limit, time_limit, lower)


def exhaustive_sharding(operations: Sequence[Operation], transfers: Sequence[Transfer], *,
                        memory_limit: float | None = None) -> ShardingSolution:
    """The optimum by enumerating every plan (for checking small problems): refuses
    problems with more than 2,000,000 plans."""
    began = time.monotonic()
    operations, transfers = _validate(operations, transfers, memory_limit)
    count = math.prod(len(op.choices) for op in operations)
    if count > _EXHAUSTIVE_PLANS:
        raise PlanError(f"exhaustive_sharding would enumerate {count:,} plans, more than {_EXHAUSTIVE_PLANS:,}; "
                        "use solve_sharding")
    free = [i for i, op in enumerate(operations) if len(op.choices) > 1]
    position = {i: p for p, i in enumerate(free)}
    # Each transfer is added once both its ends are chosen: at the later of its ends in
    # `free` order (operations with one choice are chosen from the start).
    due: list[list[Transfer]] = [[] for _ in free]
    constant = math.fsum(op.choices[0].seconds for op in operations if len(op.choices) == 1)
    for t in transfers:
        last = max(position.get(t.src, -1), position.get(t.dst, -1))
        if last < 0:
            constant += t.seconds[0][0]
        else:
            due[last].append(t)
    plan = [0] * len(operations)
    best: list[Any] = [math.inf, None]

    def visit(p: int, seconds: float) -> None:
        if p == len(free):
            if seconds < best[0] and (memory_limit is None or _peak(operations, plan) <= memory_limit):
                best[:] = [seconds, tuple(plan)]
            return
        i = free[p]
        for k, choice in enumerate(operations[i].choices):
            plan[i] = k
            visit(p + 1, seconds + choice.seconds + sum(t.seconds[plan[t.src]][plan[t.dst]] for t in due[p]))

    visit(0, constant)
    if best[1] is None:
        raise _no_fit(memory_limit, _least_peak(operations)[0])
    return _solution(operations, transfers, best[1], True, None, began, "exhaustive")


def _validate(operations: Sequence[Operation], transfers: Sequence[Transfer],
              memory_limit: float | None = None) -> tuple[tuple[Operation, ...], tuple[Transfer, ...]]:
    """The inputs as tuples, checked: every number finite and >= 0, every transfer between
    two distinct operations with a matrix of their choice counts."""
    operations, transfers = tuple(operations), tuple(transfers)
    for i, op in enumerate(operations):
        if not isinstance(op, Operation):
            raise PlanError(f"operations[{i}] must be an Operation, got {type(op).__name__}")
        where = f"operation {i} ({op.name!r})"
        if not isinstance(op.choices, (tuple, list)) or not op.choices:
            raise PlanError(f"{where} has no choices: give it at least one way to run")
        for k, c in enumerate(op.choices):
            if not isinstance(c, Choice):
                raise PlanError(f"{where} choice {k} must be a Choice, got {type(c).__name__}")
            for field in ("seconds", "resident_bytes", "working_bytes"):
                value = getattr(c, field)
                if type(value) is not float or not 0.0 <= value < math.inf:  # floats pass without a call
                    _check_amount(value, f"{where} choice {k} ({c.label!r}) {field}")
    n = len(operations)
    for e, t in enumerate(transfers):
        if not isinstance(t, Transfer):
            raise PlanError(f"transfers[{e}] must be a Transfer, got {type(t).__name__}")
        for end in ("src", "dst"):
            index = getattr(t, end)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
                raise PlanError(f"transfer {e} {end} must be an operation index in [0, {n}), got {index!r}")
        where = f"transfer {e} ({operations[t.src].name!r} -> {operations[t.dst].name!r})"
        if t.src == t.dst:
            raise PlanError(f"{where} is a self-loop on operation {t.src}: a transfer joins two operations")
        rows, cols = len(operations[t.src].choices), len(operations[t.dst].choices)
        if not isinstance(t.seconds, (tuple, list)) or len(t.seconds) != rows or any(
                not isinstance(row, (tuple, list)) or len(row) != cols for row in t.seconds):
            raise PlanError(f"{where} seconds must be a {rows} x {cols} matrix (src choices x dst choices), "
                            f"got {_shape(t.seconds)}")
        for a, row in enumerate(t.seconds):
            for b, value in enumerate(row):
                if type(value) is not float or not 0.0 <= value < math.inf:
                    _check_amount(value, f"{where} seconds[{a}][{b}]")
    if memory_limit is not None:
        _check_amount(memory_limit, "memory_limit")
    return operations, transfers


def _shape(matrix: Any) -> str:
    if not isinstance(matrix, (tuple, list)):
        return type(matrix).__name__
    return f"rows of lengths {[len(r) if isinstance(r, (tuple, list)) else type(r).__name__ for r in matrix]}"


def _check_plan(plan: Any, operations: tuple[Operation, ...], what: str) -> tuple[int, ...]:
    """``plan`` is one choice index per operation."""
    try:
        plan = tuple(plan)
    except TypeError:
        raise PlanError(f"{what} must be a sequence of choice indices, got {type(plan).__name__}") from None
    if len(plan) != len(operations):
        raise PlanError(f"{what} has {len(plan)} entries but there are {len(operations)} operations")
    for i, (k, op) in enumerate(zip(plan, operations)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < len(op.choices):
            raise PlanError(f"{what}[{i}] for operation {i} ({op.name!r}) must be a choice index in "
                            f"[0, {len(op.choices)}), got {k!r}")
    return tuple(int(k) for k in plan)


def _seconds(operations: tuple[Operation, ...], transfers: tuple[Transfer, ...], plan: Sequence[int]) -> float:
    return math.fsum([op.choices[k].seconds for op, k in zip(operations, plan)]
                     + [t.seconds[plan[t.src]][plan[t.dst]] for t in transfers])


def _peak(operations: tuple[Operation, ...], plan: Sequence[int]) -> float:
    chosen = [op.choices[k] for op, k in zip(operations, plan)]
    return math.fsum([c.resident_bytes for c in chosen] + [max((c.working_bytes for c in chosen), default=0.0)])


def _least_peak(operations: tuple[Operation, ...]) -> tuple[float, tuple[int, ...]]:
    """The smallest peak of any plan, and a plan reaching it: for each cap on the largest
    working bytes (a value some choice has), every operation takes its least resident
    choice among those under the cap; the least of cap plus those resident bytes is the
    smallest peak (at the cap equal to the best plan's largest working bytes, it is at most
    that plan's peak), and the plan of that cap reaches it."""
    by_working = sorted((c.working_bytes, c.resident_bytes, i, k) for i, op in enumerate(operations)
                        for k, c in enumerate(op.choices))
    resident = [math.inf] * len(operations)
    plan = [0] * len(operations)
    missing = len(operations)
    total = 0.0  # of `resident`, once every operation has a choice under the cap
    best, best_plan = (math.inf, tuple(plan)) if operations else (0.0, ())
    at = 0
    while at < len(by_working):
        cap = by_working[at][0]
        while at < len(by_working) and by_working[at][0] == cap:
            _, r, i, k = by_working[at]
            if resident[i] == math.inf:
                missing -= 1
                if not missing:
                    total = math.fsum(resident[:i] + [r] + resident[i + 1:])
            elif r < resident[i] and not missing:
                total += r - resident[i]
            if r < resident[i]:
                resident[i], plan[i] = r, k
            at += 1
        # The running total drifts by rounding: the exact peak settles every near tie.
        if not missing and cap + total <= best * (1 + 1e-9):
            peak = _peak(operations, plan)
            if peak < best:
                best, best_plan = peak, tuple(plan)
    return best, best_plan


def _no_fit(memory_limit: float, least: float) -> PlanError:
    return PlanError(f"no plan fits memory_limit={_bytes(memory_limit)} bytes per device: the smallest peak any "
                     f"plan reaches is {_bytes(least)} bytes (every operation's resident bytes plus the largest "
                     "working bytes); raise memory_limit to at least that, or use more devices so that each "
                     "holds less")


def _bytes(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else repr(value)


def _solution(operations: tuple[Operation, ...], transfers: tuple[Transfer, ...], plan: Sequence[int],
              optimal: bool, bound: float | None, began: float, method: str) -> ShardingSolution:
    seconds = _seconds(operations, transfers, plan)
    return ShardingSolution(tuple(int(k) for k in plan), seconds, _peak(operations, plan), optimal,
                            seconds if optimal or bound is None else min(bound, seconds),
                            time.monotonic() - began, method)


class _Reduced:
    """The problem after presolve (see the module docstring), as numpy arrays.

    Operations left with two or more choices are ``live``; ``choice[i]`` holds the original
    indices of an operation's remaining choices, and every array of that operation is
    indexed like it. ``unary[i]`` is the cost of each choice (its seconds plus what was
    moved into it), ``edges[(a, b)]`` (``a < b``) a transfer's remaining cost matrix,
    ``constant`` what every plan pays besides. ``fixed`` maps the other operations to their
    one choice; ``replaced[i]`` maps a dropped dominated choice to the one that beat it.
    ``limit_units`` is None when every plan fits; otherwise memory is also in integer
    units (``_memory_units``).
    """

    def __init__(self, operations: tuple[Operation, ...], transfers: tuple[Transfer, ...],
                 memory_limit: float | None) -> None:
        n = len(operations)
        self.operations, self.transfers = operations, transfers
        self.choice = [np.arange(len(op.choices)) for op in operations]
        self.unary = [np.array([c.seconds for c in op.choices], dtype=float) for op in operations]
        self.resident_bytes = [np.array([c.resident_bytes for c in op.choices], dtype=float) for op in operations]
        self.working_bytes = [np.array([c.working_bytes for c in op.choices], dtype=float) for op in operations]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.neighbours: list[set[int]] = [set() for _ in range(n)]
        for t in transfers:
            matrix = np.array(t.seconds, dtype=float).reshape(len(operations[t.src].choices),
                                                               len(operations[t.dst].choices))
            key = (min(t.src, t.dst), max(t.src, t.dst))
            if t.src > t.dst:
                matrix = matrix.T
            self.edges[key] = self.edges[key] + matrix if key in self.edges else matrix
            self.neighbours[t.src].add(t.dst)
            self.neighbours[t.dst].add(t.src)
        self.constant = 0.0
        self.fixed: dict[int, int] = {}
        self.replaced: list[dict[int, int]] = [{} for _ in range(n)]
        self.memory_limit = memory_limit
        self._presolve()
        self.live = [i for i in range(n) if i not in self.fixed]
        self.limit_units: int | None = None
        if self.memory_limit is not None:
            self._memory_units()

    def matrix(self, i: int, j: int) -> np.ndarray:
        """The cost matrix of the edge between ``i`` and ``j``, rows indexed by ``i``'s choices."""
        return self.edges[i, j] if i < j else self.edges[j, i].T

    def _presolve(self) -> None:
        changed = True
        while changed:
            changed = False
            if self.memory_limit is not None:
                changed |= self._drop_unfitting()
            for i in range(len(self.operations)):
                if i not in self.fixed and len(self.choice[i]) == 1:
                    self._fix(i)
                    changed = True
            for key in list(self.edges):
                changed |= self._reparametrize(*key)
            for i in range(len(self.operations)):
                if i not in self.fixed:
                    changed |= self._drop_dominated(i)
        for i in range(len(self.operations)):
            if i not in self.fixed:
                least = self.unary[i].min()
                self.constant += least
                self.unary[i] = self.unary[i] - least

    def _drop_unfitting(self) -> bool:
        """Drop choices that exceed the limit even with every other operation at its least
        resident bytes and the largest working bytes at its least; drop the limit once
        every plan fits. A relative margin of 1e-12 keeps choices that fit but for rounding."""
        limit = self.memory_limit
        least_resident = [r.min() for r in self.resident_bytes]
        base = math.fsum(least_resident)
        least_working = max((w.min() for w in self.working_bytes), default=0.0)
        changed = False
        for i in range(len(self.operations)):
            if len(self.choice[i]) < 2:
                continue
            bound = (base - least_resident[i]) + self.resident_bytes[i] + np.maximum(self.working_bytes[i],
                                                                                       least_working)
            keep = bound <= limit + 1e-12 * limit
            if not keep.all():
                self._keep(i, keep)
                changed = True
        most = math.fsum([r.max() for r in self.resident_bytes]
                         + [max((w.max() for w in self.working_bytes), default=0.0)])
        if most <= limit:
            self.memory_limit = None
            changed = True
        return changed

    def _keep(self, i: int, keep: np.ndarray) -> None:
        """Keep only the choices of operation ``i`` where ``keep`` is true."""
        self.choice[i] = self.choice[i][keep]
        self.unary[i] = self.unary[i][keep]
        self.resident_bytes[i] = self.resident_bytes[i][keep]
        self.working_bytes[i] = self.working_bytes[i][keep]
        for j in self.neighbours[i]:
            if i < j:
                self.edges[i, j] = self.edges[i, j][keep, :]
            else:
                self.edges[j, i] = self.edges[j, i][:, keep]

    def _fix(self, i: int) -> None:
        """Operation ``i`` has one choice left: its cost becomes a constant, and its edges
        costs of the neighbours' choices."""
        self.fixed[i] = int(self.choice[i][0])
        self.constant += float(self.unary[i][0])
        for j in self.neighbours[i]:
            self.unary[j] = self.unary[j] + self.matrix(i, j)[0]
            del self.edges[min(i, j), max(i, j)]
            self.neighbours[j].discard(i)
        self.neighbours[i] = set()

    def _reparametrize(self, a: int, b: int) -> bool:
        """Move each row's minimum into ``a``'s choices and each column's into ``b``'s; drop
        the edge when nothing is left. Returns whether anything moved."""
        matrix = self.edges[a, b]
        rows = matrix.min(axis=1)
        matrix = matrix - rows[:, None]
        cols = matrix.min(axis=0)
        matrix = matrix - cols[None, :]
        self.unary[a] = self.unary[a] + rows
        self.unary[b] = self.unary[b] + cols
        if not matrix.any():
            del self.edges[a, b]
            self.neighbours[a].discard(b)
            self.neighbours[b].discard(a)
            return True
        self.edges[a, b] = matrix
        return bool(rows.any() or cols.any())

    def _drop_dominated(self, i: int) -> bool:
        """Drop each choice that another remaining choice dominates (see the module docstring)."""
        unary = self.unary[i]
        # slack[a, b]: how much cheaper a is than b whatever the neighbours choose.
        slack = unary[None, :] - unary[:, None]
        for j in self.neighbours[i]:
            m = self.matrix(i, j)
            slack = slack - (m[:, None, :] - m[None, :, :]).max(axis=2)
        beats = slack >= 0
        if self.memory_limit is not None:
            r, w = self.resident_bytes[i], self.working_bytes[i]
            beats &= (r[:, None] <= r[None, :]) & (w[:, None] <= w[None, :])
        np.fill_diagonal(beats, False)
        if not beats.any():
            return False
        keep = np.ones(len(unary), dtype=bool)
        for b in range(len(unary)):
            # Dominance is transitive, so a choice dropped earlier is beaten by one still kept.
            by = np.flatnonzero(beats[:, b] & keep)
            if len(by):
                keep[b] = False
                self.replaced[i][int(self.choice[i][b])] = int(self.choice[i][by[0]])
        self._keep(i, keep)
        return True

    def _memory_units(self) -> None:
        """Memory as integers, a power of two per byte: rounded up (``up``: a plan that fits
        in these units fits in bytes; the local search uses them) and down (``down``: every
        plan that fits in bytes fits in these units; the solver uses them), the limit down."""
        most = math.fsum([r.max() for r in self.resident_bytes] + [max(w.max() for w in self.working_bytes)])
        scale = 2.0 ** math.floor(math.log2(_MEMORY_UNITS / most)) if most > 0 else 1.0
        self.limit_units = math.floor(self.memory_limit * scale)
        self.resident_up = [np.ceil(r * scale).astype(np.int64) for r in self.resident_bytes]
        self.working_up = [np.ceil(w * scale).astype(np.int64) for w in self.working_bytes]
        self.resident_down = [np.floor(r * scale).astype(np.int64) for r in self.resident_bytes]
        self.working_down = [np.floor(w * scale).astype(np.int64) for w in self.working_bytes]

    def is_forest(self) -> bool:
        return len(_spanning_forest(self.live, self.edges)) == len(self.edges)

    def local(self, plan: dict[int, int]) -> tuple[int, ...]:
        """A plan given by original choice indices, as indices into the remaining choices:
        a dropped dominated choice is replaced by what beat it. Raises KeyError when a
        choice was dropped for not fitting the memory limit."""
        out = []
        for i in self.live:
            k = plan[i]
            while k in self.replaced[i]:
                k = self.replaced[i][k]
            found = np.flatnonzero(self.choice[i] == k)
            if not len(found):
                raise KeyError(k)
            out.append(int(found[0]))
        return tuple(out)

    def expand(self, local: Sequence[int]) -> tuple[int, ...]:
        """A plan over the live operations as original choice indices for every operation."""
        plan = [0] * len(self.operations)
        for i, k in self.fixed.items():
            plan[i] = k
        for i, k in zip(self.live, local):
            plan[i] = int(self.choice[i][k])
        return tuple(plan)

    def cost(self, local: Sequence[int], edges: dict[tuple[int, int], np.ndarray] | None = None) -> float:
        """A plan's cost above ``constant`` (counting only ``edges`` of the transfers, when given)."""
        at = dict(zip(self.live, local))
        return math.fsum([float(self.unary[i][at[i]]) for i in self.live]
                         + [float(m[at[a], at[b]]) for (a, b), m in (self.edges if edges is None else edges).items()])

    def seconds(self, local: Sequence[int]) -> float:
        """A plan's time, recomputed from the inputs."""
        return _seconds(self.operations, self.transfers, self.expand(local))

    def fits(self, local: Sequence[int]) -> bool:
        """Whether a plan's peak, in bytes, is within the limit."""
        return self.memory_limit is None or _peak(self.operations, self.expand(local)) <= self.memory_limit

    def tree_optimum(self, edges: dict[tuple[int, int], np.ndarray],
                     penalty: dict[int, np.ndarray] | None = None) -> tuple[int, ...]:
        """The best plan over the live operations when ``edges`` form a forest, by dynamic
        programming from the leaves (memory aside; ``penalty`` adds to the choices' costs)."""
        around: dict[int, list[int]] = {i: [] for i in self.live}
        for a, b in edges:
            around[a].append(b)
            around[b].append(a)
        best: dict[int, int] = {}
        for root in self.live:
            if root in best:
                continue
            order, parent, stack = [], {root: -1}, [root]
            while stack:  # parents come before their children in `order`
                v = stack.pop()
                order.append(v)
                for u in around[v]:
                    if u != parent[v]:
                        parent[u] = v
                        stack.append(u)
            total = {v: self.unary[v] + penalty[v] if penalty else self.unary[v].copy() for v in order}
            pick: dict[int, np.ndarray] = {}  # child -> its best choice for each choice of its parent
            for v in reversed(order[1:]):
                p = parent[v]
                options = total[v][:, None] + self.matrix(v, p)
                pick[v] = options.argmin(axis=0)
                total[p] = total[p] + options[pick[v], np.arange(options.shape[1])]
            best[root] = int(total[root].argmin())
            for v in order[1:]:
                best[v] = int(pick[v][best[parent[v]]])
        return tuple(best[i] for i in self.live)

    def polish(self, local: Sequence[int], memory: bool, penalty: dict[int, np.ndarray] | None = None
               ) -> tuple[int, ...]:
        """Local search: move one operation at a time to its cheapest choice given its
        neighbours' (with ``memory``, among those that keep the plan within the limit in
        rounded-up units; ``penalty`` adds to the choices' costs), until no move helps."""
        costs = _LocalCosts(self, local, penalty)
        usage = _Usage(self, costs.at) if memory else None
        for _ in range(_POLISH_ROUNDS):
            moved = False
            for i in self.live:
                cost = costs.of(i)
                if usage is not None:
                    cost = np.where(usage.peaks(i) > self.limit_units, math.inf, cost)
                k = int(cost.argmin())
                if cost[k] < cost[costs.at[i]]:
                    if usage is not None:
                        usage.move(i, k)
                    costs.move(i, k)
                    moved = True
            if not moved:
                break
        return tuple(costs.at[i] for i in self.live)

    def repair(self, local: Sequence[int]) -> tuple[int, ...] | None:
        """From a plan over the memory limit, move one operation at a time to the choice that
        lowers the peak at the least extra cost per unit, until the plan fits in rounded-up
        units; None when no single move lowers the peak."""
        costs = _LocalCosts(self, local)
        usage = _Usage(self, costs.at)
        # Each operation's best move, kept until its costs change (it or a neighbour moved)
        # or the largest working bytes do: how much a move lowers the peak depends on those
        # only, not on the total resident bytes.
        moves: dict[int, tuple[float, int]] = {}
        top = usage.top
        while usage.peak() > self.limit_units:
            if usage.top != top:
                moves.clear()
                top = usage.top
            for i in self.live:
                if i not in moves:
                    cost = costs.of(i)
                    drop = usage.peak() - usage.peaks(i)
                    ratio = np.where(drop > 0, (cost - cost[costs.at[i]]) / np.maximum(drop, 1), math.inf)
                    k = int(ratio.argmin())
                    moves[i] = (float(ratio[k]), k)
            i = min(moves, key=lambda j: moves[j][0])
            if moves[i][0] == math.inf:
                return None
            k = moves[i][1]
            usage.move(i, k)
            costs.move(i, k)
            for j in [i, *self.neighbours[i]]:
                moves.pop(j, None)
        return tuple(costs.at[i] for i in self.live)

    def priced(self, edges: dict[tuple[int, int], np.ndarray], start: tuple[int, ...],
               deadline: float) -> list[tuple[int, ...]]:
        """Plans within the limit from pricing memory (a Lagrangian relaxation of the limit):
        with each resident unit costing ``price`` seconds, the optimum over the spanning forest
        ``edges``, polished, then repaired to fit and polished again. The price doubles until
        the priced plan fits, then is bisected, until ``deadline``."""
        found = []
        low, high = 0.0, None
        price = max(self.cost(start), 1e-300) / max(self.limit_units, 1)
        for _ in range(_PRICE_ROUNDS):
            if time.monotonic() > deadline:
                break
            penalty = {i: price * self.resident_up[i] for i in self.live}
            plan = self.polish(self.tree_optimum(edges, penalty), memory=False, penalty=penalty)
            fits = _Usage(self, dict(zip(self.live, plan))).peak() <= self.limit_units
            repaired = plan if fits else self.repair(plan)
            if repaired is not None:
                found.append(self.polish(repaired, memory=True))
            if fits:
                high = price
            else:
                low = price
            price = 2 * price if high is None else (low + high) / 2
        return found


class _LocalCosts:
    """For each live operation, the cost of each of its choices given its neighbours'
    choices in a plan (plus ``penalty``), recomputed only when a neighbour moves."""

    def __init__(self, problem: _Reduced, local: Sequence[int], penalty: dict[int, np.ndarray] | None = None
                 ) -> None:
        self.problem, self.penalty = problem, penalty
        self.at = dict(zip(problem.live, local))
        self.cached: dict[int, np.ndarray] = {}

    def of(self, i: int) -> np.ndarray:
        if i not in self.cached:
            p = self.problem
            cost = p.unary[i] + self.penalty[i] if self.penalty else p.unary[i].copy()
            for j in p.neighbours[i]:
                cost += p.matrix(i, j)[:, self.at[j]]
            self.cached[i] = cost
        return self.cached[i]

    def move(self, i: int, k: int) -> None:
        self.at[i] = k
        for j in self.problem.neighbours[i]:
            self.cached.pop(j, None)


class _Usage:
    """A plan's peak in rounded-up memory units, kept up to date as its choices change."""

    def __init__(self, problem: _Reduced, at: dict[int, int]) -> None:
        self.problem, self.at = problem, dict(at)
        self.fixed_working = max((int(problem.working_up[i][0]) for i in problem.fixed), default=0)
        self.resident = (sum(int(problem.resident_up[i][0]) for i in problem.fixed)
                         + sum(int(problem.resident_up[i][k]) for i, k in self.at.items()))
        self._rank()

    def _rank(self) -> None:
        self.top = heapq.nlargest(2, ((int(self.problem.working_up[i][k]), i) for i, k in self.at.items()))

    def peak(self) -> int:
        return self.resident + max([self.fixed_working] + [w for w, _ in self.top[:1]])

    def peaks(self, i: int) -> np.ndarray:
        """The peak with each choice of operation ``i`` instead of its own."""
        others = max([self.fixed_working] + [w for w, j in self.top if j != i][:1])
        resident = self.problem.resident_up[i]
        return self.resident - int(resident[self.at[i]]) + resident + np.maximum(self.problem.working_up[i], others)

    def move(self, i: int, k: int) -> None:
        self.resident += int(self.problem.resident_up[i][k]) - int(self.problem.resident_up[i][self.at[i]])
        self.at[i] = k
        self._rank()


def _spanning_forest(nodes: Sequence[int],
                     edges: dict[tuple[int, int], np.ndarray]) -> dict[tuple[int, int], np.ndarray]:
    """The edges of a spanning forest (union-find, in order)."""
    parent = {v: v for v in nodes}

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    kept = {}
    for (a, b), m in edges.items():
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[ra] = rb
            kept[a, b] = m
    return kept


def _optimum(problem: _Reduced, starts: list[tuple[int, ...]], began: float, deadline: float, time_limit: float,
             lower: float = 0.0) -> ShardingSolution:
    """The optimum of the reduced problem: by dynamic programming over a forest without a
    memory limit, else by CP-SAT from the cheapest of the starting plans (mapped onto the
    remaining choices), the spanning-forest optimum and, under a memory limit, plans from
    pricing memory, each repaired to fit when it does not and polished by local search.
    ``lower`` is a known lower bound on the optimal seconds."""
    operations, transfers = problem.operations, problem.transfers
    memory = problem.limit_units is not None
    if not memory and problem.is_forest():
        return _solution(operations, transfers, problem.expand(problem.tree_optimum(problem.edges)), True, None,
                         began, "dp")
    candidates = []
    for plan in starts:
        try:
            candidates.append(problem.local(dict(enumerate(plan))))
        except KeyError:  # a choice that cannot fit the memory limit
            continue
    forest = _spanning_forest(problem.live, problem.edges)
    tree = problem.tree_optimum(forest)
    # Every transfer costs at least zero once reparametrized, so the optimum over the
    # spanning forest's transfers alone bounds the optimum from below.
    lower = max(lower, problem.constant + problem.cost(tree, forest))
    free = problem.polish(tree, memory=False)
    candidates.append(free)
    if memory:
        candidates += problem.priced(forest, free, time.monotonic() + (deadline - time.monotonic()) / 4)
        candidates = [c if problem.fits(c) else problem.repair(c) for c in candidates]
    polished = [problem.polish(c, memory) for c in candidates if c is not None]
    # The smallest-peak plan fits whenever a limit binds, so some candidate does.
    incumbent = min((c for c in polished if problem.fits(c)), key=problem.seconds)
    if lower >= problem.constant + problem.cost(incumbent) * (1 - _TOLERANCE):  # already proven optimal
        return _solution(operations, transfers, problem.expand(incumbent), True, lower, began, "cp-sat")
    found, optimal, cost = _search(problem, incumbent, memory, deadline, time_limit)
    bound = max(lower, problem.constant + cost)
    optimal = optimal or bound >= problem.constant + problem.cost(found) * (1 - _TOLERANCE)
    return _solution(operations, transfers, problem.expand(found), optimal, bound, began, "cp-sat")


def _search(problem: _Reduced, incumbent: tuple[int, ...], memory: bool, deadline: float,
            time_limit: float) -> tuple[tuple[int, ...], bool, float]:
    """The best plan CP-SAT finds from ``incumbent`` by ``deadline``, whether it is proven
    optimal, and a proven lower bound on the optimal cost above ``problem.constant``.

    Time units are scaled to the incumbent's cost and, when that is too coarse for the plan
    found, once more to the plan's (see "Exactness"). The model's memory is rounded down,
    so it admits every plan that fits; an optimum that does not fit in bytes (rounding
    admitted it) is excluded and the model solved again."""
    building = _BUILD_SECONDS_PER_ENTRY * sum(m.size for m in problem.edges.values())
    if deadline - time.monotonic() <= _wrap_up(time_limit) + 2 * building:  # no time left for the solver
        return incumbent, False, 0.0
    reference = problem.cost(incumbent)
    terms = len(problem.live) + len(problem.edges)
    excluded: list[tuple[int, ...]] = []
    while True:
        scale = _MAX_UNITS / reference if reference > 0 else 1.0
        model = _SatModel(problem, scale, incumbent, memory, excluded)
        found, optimal, bound_units = model.solve(deadline - time.monotonic() - _wrap_up(time_limit))
        best = min([c for c in found if problem.fits(c)] + [incumbent], key=problem.seconds)
        time_left = deadline - time.monotonic() > 2 * _wrap_up(time_limit)
        if optimal and found and not problem.fits(found[-1]):
            optimal = False
            if time_left and len(excluded) < _EXCLUDED_PLANS:
                excluded.append(found[-1])
                incumbent = best
                continue
        if (optimal and time_left and 1.5 * terms / scale > _TOLERANCE * problem.seconds(best)
                and 2 * problem.cost(best) < reference):
            reference, incumbent = problem.cost(best), best
            continue
        break
    # A plan's integer cost exceeds its cost times scale by less than a unit per term.
    return best, optimal, min(problem.cost(best), max(0.0, (bound_units - terms) / scale))


class _SatModel:
    """The reduced problem as a CP-SAT model, costs in integer units of ``1 / scale`` seconds,
    within the memory limit when ``memory``."""

    def __init__(self, problem: _Reduced, scale: float, incumbent: tuple[int, ...], memory: bool,
                 excluded: Sequence[tuple[int, ...]]) -> None:
        cp_model = sat.cp_model()

        self.problem = problem
        cp = self.cp = cp_model.CpModel()
        live = problem.live
        at = dict(zip(live, incumbent))
        # The incumbent's cost in units; a cost above it is clipped to just above (no plan
        # that pays it can be better), which keeps every coefficient small.
        top = (sum(int(_units(problem.unary[i][at[i]:at[i] + 1], scale, math.inf)[0]) for i in live)
               + sum(int(_units(m[at[a]:at[a] + 1, at[b]], scale, math.inf)[0])
                     for (a, b), m in problem.edges.items()))
        x = self.x = {i: [cp.new_bool_var(f"x_{i}_{k}") for k in range(len(problem.choice[i]))] for i in live}
        unary = {i: _units(problem.unary[i], scale, top + 1) for i in live}
        variables, coefficients = [], []
        self.pairs: list[tuple[int, int, np.ndarray, np.ndarray, list[list]]] = []
        for i in live:
            cp.add_exactly_one(x[i])
        for (a, b), m in problem.edges.items():
            cost = _units(m, scale, top + 1)
            rows, row_of = np.unique(cost, axis=0, return_inverse=True)
            cols, col_of = np.unique(cost, axis=1, return_inverse=True)
            row_of, col_of = row_of.reshape(-1), col_of.reshape(-1)
            if len(rows) == 1:  # the cost depends on b's choice alone
                unary[b] = unary[b] + rows[0]
                continue
            if cols.shape[1] == 1:
                unary[a] = unary[a] + cols[:, 0]
                continue
            # One Boolean per (row group, column group): their sum over a row group is a's
            # choice being in it, over a column group b's.
            grouped = rows[:, np.unique(col_of, return_index=True)[1]]
            y = [[cp.new_bool_var(f"y_{a}_{b}_{g}_{h}") for h in range(grouped.shape[1])]
                 for g in range(grouped.shape[0])]
            for g, row in enumerate(y):
                cp.add(sum(row) == sum(x[a][s] for s in np.flatnonzero(row_of == g)))
            for h in range(grouped.shape[1]):
                cp.add(sum(row[h] for row in y) == sum(x[b][t] for t in np.flatnonzero(col_of == h)))
            for g, row in enumerate(y):
                for h, var in enumerate(row):
                    if grouped[g, h]:
                        variables.append(var)
                        coefficients.append(int(grouped[g, h]))
            self.pairs.append((a, b, row_of, col_of, y))
        for i in live:
            for k, var in enumerate(x[i]):
                if unary[i][k]:
                    variables.append(var)
                    coefficients.append(int(unary[i][k]))
        objective = cp_model.LinearExpr.weighted_sum(variables, coefficients)
        self.at_least: list = []
        if memory:
            self._memory()
        for plan in excluded:
            cp.add_bool_or([~x[i][k] for i, k in zip(live, plan)])
        cp.minimize(objective)
        self._hint(incumbent)

    def _memory(self) -> None:
        """Resident bytes plus the largest working bytes within the limit, in rounded-down
        units. The largest working bytes is a staircase: ``at_least[l]`` says it reaches the
        l-th distinct value, implied by each operation's choices at or above it."""
        problem, cp, x = self.problem, self.cp, self.x
        floor = max((int(problem.working_down[i][0]) for i in problem.fixed), default=0)
        working = {i: np.maximum(problem.working_down[i], floor) for i in problem.live}
        levels = self.levels = sorted({int(v) for w in working.values() for v in w} | {floor})
        at_least = self.at_least = [cp.new_bool_var(f"working_at_least_{v}") for v in levels[1:]]
        for lower, higher in zip(at_least, at_least[1:]):
            cp.add_implication(higher, lower)
        index = {v: l for l, v in enumerate(levels)}
        for i in problem.live:
            for level in sorted({index[int(v)] for v in working[i]} - {0}):
                cp.add(sum(x[i][k] for k in np.flatnonzero(working[i] >= levels[level])) <= at_least[level - 1])
        resident = sum(int(problem.resident_down[i][0]) for i in problem.fixed)
        peak = (resident + levels[0]
                + sum(int(r) * var for i in problem.live for r, var in zip(problem.resident_down[i], x[i]))
                + sum((levels[l] - levels[l - 1]) * at_least[l - 1] for l in range(1, len(levels))))
        cp.add(peak <= problem.limit_units)

    def _hint(self, plan: tuple[int, ...]) -> None:
        """Every variable's value in ``plan``, as the solver's starting point (a complete
        hint is a solution at once; a partial one has to be completed by search)."""
        problem, cp = self.problem, self.cp
        at = dict(zip(problem.live, plan))
        for i, k in at.items():
            for j, var in enumerate(self.x[i]):
                cp.add_hint(var, j == k)
        for a, b, row_of, col_of, y in self.pairs:
            for g, row in enumerate(y):
                for h, var in enumerate(row):
                    cp.add_hint(var, g == row_of[at[a]] and h == col_of[at[b]])
        if self.at_least:
            largest = max(int(problem.working_down[i][k]) for i, k in at.items())
            for level, var in zip(self.levels[1:], self.at_least):
                cp.add_hint(var, level <= largest)

    def solve(self, seconds: float) -> tuple[list[tuple[int, ...]], bool, float]:
        """The plans the solver finds within ``seconds``, whether the last is proven optimal,
        and the proven bound in units."""
        cp_model = sat.cp_model()

        problem, x = self.problem, self.x
        solver = _sat_solver(seconds, sum(len(v) for v in x.values()))
        collector = _collector_class()(problem.live, x)
        status = solver.solve(self.cp, collector)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return collector.found, False, 0.0
        return collector.found, status == cp_model.OPTIMAL, solver.best_objective_bound


def _sat_solver(seconds: float, cells: int) -> cp_model.CpSolver:
    """The solver for these models: one worker that solves the full linear relaxation at
    every node (it proves most optima at the root, the relaxation being tight) beside one
    that restarts often, with the large-neighbourhood searches between them. CP-SAT's
    presolve rewrites the marginal equalities into forms the default relaxation leaves out,
    and costs more time than it saves here, so it is off."""
    solver = _cp_solver(seconds, cells, workers=2)
    solver.parameters.subsolvers.extend(["max_lp", "quick_restart"])
    solver.parameters.cp_model_presolve = False
    return solver


def _units(seconds: np.ndarray, scale: float, top: float) -> np.ndarray:
    """Costs in integer units, at most ``top``; a positive cost is at least one unit."""
    out = np.rint(np.minimum(seconds * scale, top))
    out[(seconds > 0) & (out < 1)] = 1
    return out.astype(np.int64)


@functools.cache
def _collector_class() -> type:
    """A solution callback recording every plan the solver finds (a class made on first use,
    as OR-Tools is imported only when needed)."""
    cp_model = sat.cp_model()

    class Collector(cp_model.CpSolverSolutionCallback):
        def __init__(self, live: Sequence[int], x: dict[int, list]) -> None:
            super().__init__()
            self.live, self.x = live, x
            self.found: list[tuple[int, ...]] = []

        def on_solution_callback(self) -> None:
            self.found.append(tuple(next(k for k, var in enumerate(self.x[i]) if self.boolean_value(var))
                                    for i in self.live))

    return Collector
