"""Ring order: in which cyclic order devices pass blocks to each other (as ring attention does).

Model: ``n`` devices and a latency matrix, ``latency[a][b]`` the seconds for a message from
``a`` to ``b`` (the diagonal is ignored; the matrix may be asymmetric). A ring is a cyclic
order ``order[0] = 0, order[1], ..., order[n-1]``; every step, each device sends to the next,
``order[k] -> order[(k + 1) % n]``, and all sends of a step run at once, so a step lasts as
long as the ring's slowest hop. The best ring first minimises that bottleneck hop, then,
among rings with the same bottleneck, the total of its hop latencies (the time one message
takes all the way round).

Solvers, both exact in the bottleneck (the second to a rounding in the total):

- up to ``_BRUTE_FORCE_MAX`` devices, every order with device 0 first is scored (at most
  5040); ties go to the lexicographically first order;
- past that, OR-Tools CP-SAT with a circuit constraint, in two solves. The first minimises
  the bottleneck over the ranks of the distinct latencies (integers, so it is exact). The
  second forbids every hop slower than that bottleneck and minimises the total, with
  latencies rounded to integer units of ``n * bottleneck * 2**-36`` (so that no total
  exceeds 2^36 units: CP-SAT's relaxation works in doubles). Rounding moves a ring's total
  by at most ``n / 2`` units, so the total of the ring returned is within
  ``n**2 * 2**-36`` bottlenecks of the least (about 4e-9 of it for 16 devices); the
  bottleneck itself is exact. Past the ``time_limit`` the best ring found comes back.
  Set ``PATHWAYS_PLAN_LOG=1`` to see CP-SAT's search log.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from typing import TYPE_CHECKING, Any, Sequence

from pathways import config
from pathways.planner import sat
from pathways.planner.topology import PlanError, Topology, _check_time_limit, _check_topology, _nonempty

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

# Up to this many devices every order is scored: 7! = 5040 orders take milliseconds.
_BRUTE_FORCE_MAX = 8
# The largest total in the second CP-SAT solve's integer units (see the module docstring).
_MAX_UNITS = 2 ** 36


def best_ring(latency: Sequence[Sequence[float]], *, time_limit: float = 10.0) -> tuple[int, ...]:
    """The ring order over devices ``0..n-1`` (a cyclic sequence starting with 0) whose slowest
    hop (``latency[order[k]][order[(k + 1) % n]]``, the direction data moves) is as fast as
    possible; among those, the least total latency. Exact up to 8 devices; past that CP-SAT
    finds it within ``time_limit`` seconds, its total to a rounding (module docstring)."""
    matrix = _checked_matrix(latency)
    _check_time_limit(time_limit)
    n = len(matrix)
    if n <= 2:
        return tuple(range(n))
    if n <= _BRUTE_FORCE_MAX:
        return _brute_force_ring(matrix)
    return _cp_sat_ring(matrix, time_limit)


def ring_latencies(latency: Sequence[Sequence[float]], order: Sequence[int]) -> list[float]:
    """The hop latencies of the ring ``order``, in order: hop ``k`` goes from ``order[k]`` to
    ``order[(k + 1) % n]``. A ring of one device has no hops."""
    matrix = _checked_matrix(latency)
    order = _checked_order(order, len(matrix))
    return _hops(matrix, order)


def ring_from_topology(topology: Topology, device_ids: Sequence[str], *,
                       time_limit: float = 10.0) -> tuple[int, ...]:
    """``best_ring`` over ``device_ids`` of ``topology``, latencies from ``topology.link(a, b)``:
    the order is of indices into ``device_ids``, starting with 0."""
    _check_topology(topology, "order in a ring")
    ids = list(_nonempty(device_ids, "device_ids", str, "a device id (a string)",
                         "name at least one device of the topology to order in a ring"))
    for d in ids:
        topology.device(d)
    if len(set(ids)) != len(ids):
        twice = sorted({d for d in ids if ids.count(d) > 1})
        raise PlanError(f"device_ids names {twice} more than once; a ring visits each device once")
    matrix = [[0.0 if a == b else topology.link(a, b).latency for b in ids] for a in ids]
    return best_ring(matrix, time_limit=time_limit)


def _checked_matrix(latency: Any) -> list[list[float]]:
    """``latency`` as a list of float rows: square, at least 1 x 1, every off-diagonal entry a
    finite number >= 0 (the diagonal is not read)."""
    try:
        rows = [list(row) for row in latency]
    except TypeError:
        raise PlanError(f"latency must be a square matrix (a sequence of rows), got {type(latency).__name__}") \
            from None
    n = len(rows)
    if n == 0:
        raise PlanError("latency is empty: a ring needs at least one device")
    matrix = []
    for a, row in enumerate(rows):
        if len(row) != n:
            raise PlanError(f"latency must be square: it has {n} rows but row {a} has {len(row)} entries")
        out = []
        for b, x in enumerate(row):
            if a == b:
                out.append(0.0)
                continue
            if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
                raise PlanError(f"latency[{a}][{b}] must be a finite number >= 0 (seconds), got {x!r}")
            out.append(float(x))
        matrix.append(out)
    return matrix


def _checked_order(order: Any, n: int) -> tuple[int, ...]:
    try:
        order = tuple(order)
    except TypeError:
        raise PlanError(f"order must be a sequence of device indices, got {type(order).__name__}") from None
    if sorted(order) != list(range(n)) or any(isinstance(i, bool) for i in order):
        raise PlanError(f"order must be a permutation of 0..{n - 1} (each device once), got {order!r}")
    return order


def _hops(matrix: list[list[float]], order: Sequence[int]) -> list[float]:
    n = len(order)
    if n == 1:
        return []
    return [matrix[order[k]][order[(k + 1) % n]] for k in range(n)]


def _brute_force_ring(matrix: list[list[float]]) -> tuple[int, ...]:
    """The best ring by scoring every order with device 0 first; the first best in
    lexicographic order wins a tie."""
    n = len(matrix)
    best: tuple[int, ...] = tuple(range(n))
    best_key = (math.inf, math.inf)
    for rest in itertools.permutations(range(1, n)):
        order = (0, *rest)
        hops = _hops(matrix, order)
        key = (max(hops), math.fsum(hops))
        if key < best_key:
            best, best_key = order, key
    return best


def _cp_sat_ring(matrix: list[list[float]], time_limit: float) -> tuple[int, ...]:
    """The best ring by CP-SAT (module docstring), for any ``n >= 3``; the best found when the
    time limit ends a solve."""
    deadline = time.monotonic() + time_limit
    n = len(matrix)
    arcs = [(a, b) for a in range(n) for b in range(n) if a != b]
    values = sorted({matrix[a][b] for a, b in arcs})
    rank = {x: r for r, x in enumerate(values)}

    # Solve 1: the bottleneck, as the rank of the slowest hop used. The identity ring is a
    # feasible start, so a solve cut short still has a ring to return.
    start = tuple(range(n))
    cp, uses = _circuit_model(n, arcs, start)
    bottleneck = cp.new_int_var(0, len(values) - 1, "bottleneck")
    for a, b in arcs:
        cp.add(bottleneck >= rank[matrix[a][b]]).only_enforce_if(uses[a, b])
    cp.minimize(bottleneck)
    order = _solve(cp, uses, n, deadline) or start
    limit = max(_hops(matrix, order))

    # Solve 2: the least total with no hop slower than that bottleneck.
    allowed = [(a, b) for a, b in arcs if matrix[a][b] <= limit]
    cp, uses = _circuit_model(n, allowed, order)
    unit = n * limit / _MAX_UNITS if limit > 0 else 1.0
    cp.minimize(sum(round(matrix[a][b] / unit) * uses[a, b] for a, b in allowed))
    return _solve(cp, uses, n, deadline) or order


def _circuit_model(n: int, arcs: list[tuple[int, int]],
                   hint: Sequence[int]) -> tuple[cp_model.CpModel, dict[tuple[int, int], Any]]:
    """A model whose Booleans ``uses[a, b]`` pick the arcs of one Hamiltonian circuit over
    ``n`` nodes from ``arcs``, hinted with the ring ``hint``."""
    cp_model = sat.cp_model()

    cp = cp_model.CpModel()
    uses = {(a, b): cp.new_bool_var(f"hop_{a}_{b}") for a, b in arcs}
    cp.add_circuit([(a, b, x) for (a, b), x in uses.items()])
    hinted = {(hint[k], hint[(k + 1) % n]) for k in range(n)}
    for arc, x in uses.items():
        cp.add_hint(x, arc in hinted)
    return cp, uses


def _solve(cp: cp_model.CpModel, uses: dict[tuple[int, int], Any], n: int, deadline: float) -> tuple[int, ...] | None:
    """The ring of the best solution found before ``deadline``, from device 0; None if none."""
    cp_model = sat.cp_model()

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, deadline - time.monotonic())
    solver.parameters.num_workers = 8
    solver.parameters.log_search_progress = bool(config.PLAN_LOG.get())
    if solver.solve(cp) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    succ = {a: b for (a, b), x in uses.items() if solver.boolean_value(x)}
    order = [0]
    while len(order) < n:
        order.append(succ[order[-1]])
    return tuple(order)
