"""The gang scheduler: when each submitted run is dispatched. Pure: no I/O, no clocks.

Every run of every client goes through this one sequencer, and the order in which it
releases runs is the order in which every worker executes them. Since all workers of an
island see one total order, SPMD computations spanning several hosts meet their peers in
the same order everywhere and cannot deadlock, whichever client or program they came from.

Admission is bounded per island: while several sessions have work queued for an island, at
most ``window`` runs touching it are in flight (dispatched, not yet reported done), which keeps
the devices fed while leaving queued work for the policy to order. A session alone on an
island has nothing to be ordered against, so it may run ahead up to ``SOLO_FACTOR`` windows,
enough to hide the round trip of done reports behind small computations. The policies:

- ``fifo``: the oldest admissible run first.
- ``fair``: proportional share by session weight (stride scheduling). Each dispatch charges
  the session ``cost / weight`` of virtual time, where cost is the run's expected device
  seconds (the last measurement of the same program); completion corrects the charge to
  the measured cost. The session with the least virtual time goes next, so over any busy
  period device time splits in proportion to the weights.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from pathways.defaults import DEFAULT_WINDOW

POLICIES = ("fifo", "fair")
SOLO_FACTOR = 4  # how many windows a session alone on an island may have in flight
DEFAULT_COST = 1e-3  # seconds charged for a program that never finished before


@dataclass
class Run:
    """A submitted run: who sent it, which islands it occupies, and what to dispatch."""

    session: int
    islands: frozenset[int]
    program: Hashable  # runs of one program share a cost estimate
    payload: Any = None
    id: int = -1  # numbered in submission order
    charged: float = 0.0


@dataclass
class _Session:
    weight: float
    queue: deque[Run] = field(default_factory=deque)
    vtime: float = 0.0
    inflight: int = 0
    device_seconds: float = 0.0
    completed: int = 0


class Scheduler:
    def __init__(self, policy: str = "fair", window: int = DEFAULT_WINDOW) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        if window < 1:
            raise ValueError(f"the in-flight window must be at least 1 run per island, got {window}")
        self.policy = policy
        self.window = window
        self._sessions: dict[int, _Session] = {}
        self._inflight: dict[int, Run] = {}
        self._island_load: dict[int, int] = {}
        self._cost: dict[Hashable, float] = {}
        self._ids = itertools.count(1)
        self._vclock = 0.0  # virtual time of the latest dispatch

    # ---- sessions -------------------------------------------------------------------

    def add_session(self, session: int, weight: float = 1.0) -> None:
        if not weight > 0:
            raise ValueError(f"a session's weight must be positive, got {weight!r}")
        self._sessions[session] = _Session(float(weight))

    def set_weight(self, session: int, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"a session's weight must be positive, got {weight!r}")
        self._sessions[session].weight = float(weight)

    def remove_session(self, session: int) -> None:
        """Forget a session and its queued runs; its runs in flight finish as usual."""
        self._sessions.pop(session, None)

    # ---- runs -----------------------------------------------------------------------

    def submit(self, run: Run) -> Run:
        s = self._sessions[run.session]
        if not s.queue and not s.inflight:
            # A session returning from idle starts at the present, not with banked credit.
            s.vtime = max(s.vtime, self._vclock)
        run.id = next(self._ids)
        s.queue.append(run)
        return run

    def dispatchable(self) -> Iterator[Run]:
        """Release runs, in the order workers must execute them, while windows allow."""
        while (run := self._pick()) is not None:
            s = self._sessions[run.session]
            s.queue.popleft()
            s.inflight += 1
            for island in run.islands:
                self._island_load[island] = self._island_load.get(island, 0) + 1
            run.charged = self._cost.get(run.program, DEFAULT_COST)
            self._vclock = s.vtime
            s.vtime += run.charged / s.weight
            self._inflight[run.id] = run
            yield run

    def running(self, run_id: int) -> Run | None:
        """The dispatched, unfinished run ``run_id``, if any."""
        return self._inflight.get(run_id)

    def finish(self, run_id: int, device_seconds: float | None) -> Run | None:
        """A run completed on all its workers (``device_seconds`` None: it was abandoned)."""
        run = self._inflight.pop(run_id, None)
        if run is None:
            return None
        for island in run.islands:
            self._island_load[island] -= 1
        s = self._sessions.get(run.session)
        if device_seconds is not None:
            self._cost[run.program] = device_seconds
        if s is not None:
            s.inflight -= 1
            if device_seconds is not None:
                s.vtime += (device_seconds - run.charged) / s.weight
                s.device_seconds += device_seconds
                s.completed += 1
        return run

    def cancel(self, doomed: Callable[[Run], bool]) -> tuple[list[Run], list[Run]]:
        """Remove every queued and in-flight run for which ``doomed`` holds.

        Returns (queued, in_flight) runs removed; in-flight ones free their window slots.
        """
        queued: list[Run] = []
        for s in self._sessions.values():
            keep: deque[Run] = deque()
            for r in s.queue:
                (queued if doomed(r) else keep).append(r)
            s.queue = keep
        flying = [r for r in self._inflight.values() if doomed(r)]
        for r in flying:
            self.finish(r.id, None)
        return queued, flying

    def _pick(self) -> Run | None:
        best: Run | None = None
        best_key: tuple = ()
        for sid, s in self._sessions.items():
            if not s.queue:
                continue
            head = s.queue[0]
            if any(self._island_full(i, sid) for i in head.islands):
                continue
            key = (head.id,) if self.policy == "fifo" else (s.vtime, head.id)
            if best is None or key < best_key:
                best, best_key = head, key
        return best

    def _island_full(self, island: int, session: int) -> bool:
        load = self._island_load.get(island, 0)
        if load < self.window:
            return False
        if load >= self.window * SOLO_FACTOR:
            return True
        return any(other != session and o.queue and island in o.queue[0].islands
                   for other, o in self._sessions.items())

    # ---- status ---------------------------------------------------------------------

    def inflight(self, island: int) -> int:
        return self._island_load.get(island, 0)

    def queued(self, island: int) -> int:
        return sum(1 for s in self._sessions.values() for r in s.queue if island in r.islands)

    def session_stats(self, session: int) -> dict[str, Any]:
        s = self._sessions.get(session)
        if s is None:
            return {}
        return {"weight": s.weight, "queued": len(s.queue), "inflight": s.inflight,
                "completed": s.completed, "device_seconds": s.device_seconds}
