"""The gang scheduler: when each submitted run is dispatched. Pure: no I/O, no clocks.

Every run of every client goes through this one sequencer, and the order in which it
releases runs is the order in which every worker executes them. Since all workers of an
island see one total order, SPMD computations spanning several hosts meet their peers in
the same order everywhere and cannot deadlock, whichever client or program they came from.

Admission is bounded per island: while several sessions have work queued for an island, at
most ``window`` runs touching it are in flight (dispatched, not yet reported done), which keeps
the devices fed while leaving queued work for the policy to order. A session alone on an
island has nothing to be ordered against, so it may run ahead up to ``SOLO_FACTOR`` windows,
enough to hide the round trip of done reports behind small computations.

A session's runs keep their submission order on each island, not across islands: a run
waits only for the earlier runs of its session that share an island with it, so a full
or stalled island (a host frozen until it is declared lost) never holds up the session's
work on other islands. Runs on disjoint islands share no workers, hence no data and no
collectives, and their order between them does not matter. The policies:

- ``fifo``: the oldest admissible run first.
- ``fair``: proportional share by session weight (stride scheduling). Each dispatch charges
  the session ``cost / weight`` of virtual time, where cost is the run's expected device
  seconds (the last measurement of the same program); completion corrects the charge to
  the measured cost. The session with the least virtual time goes next, so over any busy
  period device time splits in proportion to the weights.

A queued run may take on later runs of its session (``join``: the controller coalesces a
client's consecutive op-by-op runs into one dispatch); it then holds one window slot for
all of them, is charged their summed cost, and its measured device time is shared out
among their programs in proportion to their estimates.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

from pathways.defaults import DEFAULT_WINDOW
from pathways.protocol.messages import POLICIES

SOLO_FACTOR = 4  # how many windows a session alone on an island may have in flight
DEFAULT_COST = 1e-3  # seconds charged for a program that never finished before


@dataclass
class ScheduledRun:
    """A submitted run: who sent it, which islands it occupies, and what to dispatch."""

    session: int
    islands: frozenset[int]
    program: Hashable  # runs of one program share a cost estimate
    payload: Any = None
    id: int = -1  # numbered in submission order
    charged: float = 0.0
    joined: list[Hashable] = field(default_factory=list)  # the programs of the runs it took on (join)
    queued: bool = False  # submitted and not yet dispatched or cancelled


@dataclass
class _Session:
    weight: float
    # island -> the queued runs that touch it, in submission order (a run is in the queue
    # of each of its islands; runs touching none queue under None)
    queues: dict[Hashable, deque[ScheduledRun]] = field(default_factory=dict)
    waiting: int = 0  # queued runs
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
        self._inflight: dict[int, ScheduledRun] = {}
        self._island_load: dict[int, int] = {}
        # queue key -> the sessions with runs queued under it: a pick looks only at sessions
        # queued for an island with room, and whether a session is alone on an island must
        # not cost a scan of every session (hundreds of clients: a pick per done report)
        self._queued_by: dict[Hashable, set[int]] = {}
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
        s = self._sessions.pop(session, None)
        for key, queue in s.queues.items() if s is not None else ():
            self._unqueue(key, session)
            for run in queue:
                run.queued = False

    # ---- runs -----------------------------------------------------------------------

    def submit(self, run: ScheduledRun) -> ScheduledRun:
        s = self._sessions[run.session]
        if not s.waiting and not s.inflight:
            # A session returning from idle starts at the present, not with banked credit.
            s.vtime = max(s.vtime, self._vclock)
        run.id = next(self._ids)
        run.queued = True
        for key in _keys(run):
            self._enqueue(s, key, run)
        s.waiting += 1
        return run

    def _enqueue(self, s: _Session, key: Hashable, run: ScheduledRun) -> None:
        queue = s.queues.get(key)
        if queue is None:
            queue = s.queues[key] = deque()
            self._queued_by.setdefault(key, set()).add(run.session)
        queue.append(run)

    def _unqueue(self, key: Hashable, session: int) -> None:
        """``session``'s queue under ``key`` is gone."""
        sessions = self._queued_by[key]
        sessions.discard(session)
        if not sessions:
            del self._queued_by[key]

    def dispatchable(self) -> Iterator[ScheduledRun]:
        """Release runs, in the order workers must execute them, while windows allow."""
        while (run := self._pick()) is not None:
            s = self._sessions[run.session]
            for key in _keys(run):  # it heads each of its islands' queues
                queue = s.queues[key]
                queue.popleft()
                if not queue:
                    del s.queues[key]
                    self._unqueue(key, run.session)
            s.waiting -= 1
            s.inflight += 1
            run.queued = False
            for island in run.islands:
                self._island_load[island] = self._island_load.get(island, 0) + 1
            run.charged = self.estimate(run)
            self._vclock = s.vtime
            s.vtime += run.charged / s.weight
            self._inflight[run.id] = run
            yield run

    def join(self, run: ScheduledRun, program: Hashable) -> None:
        """Have queued ``run`` take on a later run of its session, of ``program``: the two
        are dispatched together, in one window slot (the caller sends them in order)."""
        if not run.queued:
            raise ValueError(f"run {run.id} is no longer queued: only a queued run takes on others")
        run.joined.append(program)

    def cost(self, program: Hashable) -> float:
        """The expected device seconds of one run of ``program``."""
        return self._cost.get(program, DEFAULT_COST)

    def estimate(self, run: ScheduledRun) -> float:
        """The expected device seconds of ``run`` with the runs it took on."""
        return self.cost(run.program) + sum(self.cost(p) for p in run.joined)

    def runs_of(self, session: int) -> Iterator[ScheduledRun]:
        """The session's runs queued or in flight (a run queued for several islands once)."""
        s = self._sessions.get(session)
        seen: set[int] = set()
        for queue in s.queues.values() if s is not None else ():
            for run in queue:
                if id(run) not in seen:
                    seen.add(id(run))
                    yield run
        for run in self._inflight.values():
            if run.session == session:
                yield run

    def in_flight(self) -> Iterator[ScheduledRun]:
        """Every dispatched, unfinished run, in the order of dispatch."""
        return iter(self._inflight.values())

    def running(self, run_id: int) -> ScheduledRun | None:
        """The dispatched, unfinished run ``run_id``, if any."""
        return self._inflight.get(run_id)

    def oldest_in_flight(self, island: int) -> ScheduledRun | None:
        """The first dispatched of the unfinished runs on ``island``: the one its workers
        execute first, since they follow the order of dispatch."""
        return next((r for r in self._inflight.values() if island in r.islands), None)

    def finish(self, run_id: int, device_seconds: float | None) -> ScheduledRun | None:
        """A run completed on all its workers (``device_seconds`` None: it was abandoned)."""
        run = self._inflight.pop(run_id, None)
        if run is None:
            return None
        for island in run.islands:
            self._island_load[island] -= 1
        s = self._sessions.get(run.session)
        if device_seconds is not None:
            if run.joined:
                programs = (run.program, *run.joined)
                estimates = [self.cost(p) for p in programs]
                total = sum(estimates)
                for program, estimate in zip(programs, estimates):
                    self._cost[program] = device_seconds * estimate / total
            else:
                self._cost[run.program] = device_seconds
        if s is not None:
            s.inflight -= 1
            if device_seconds is not None:
                s.vtime += (device_seconds - run.charged) / s.weight
                s.device_seconds += device_seconds
                s.completed += 1 + len(run.joined)
        return run

    def cancel(self, doomed: Callable[[ScheduledRun], bool]) -> tuple[list[ScheduledRun], list[ScheduledRun]]:
        """Remove every queued and in-flight run for which ``doomed`` holds.

        Returns (queued, in_flight) runs removed; in-flight ones free their window slots.
        """
        queued: list[ScheduledRun] = []
        for sid, s in self._sessions.items():
            waiting = sorted({r.id: r for q in s.queues.values() for r in q}.values(), key=lambda r: r.id)
            for key in s.queues:
                self._unqueue(key, sid)
            s.queues = {}
            s.waiting = 0
            for r in waiting:
                if doomed(r):
                    r.queued = False
                    queued.append(r)
                    continue
                for key in _keys(r):
                    self._enqueue(s, key, r)
                s.waiting += 1
        flying = [r for r in self._inflight.values() if doomed(r)]
        for r in flying:
            self.finish(r.id, None)
        return queued, flying

    def _pick(self) -> ScheduledRun | None:
        """The next run to release: the least by the policy's key of each session's
        ``_next_of``. Only sessions queued for an island that is not full for all of them
        are looked at, in the order of a bound on their key (a run is one of its session's
        queue heads), until the bound passes the best key found."""
        candidates: set[int] = set()
        for key, sessions in self._queued_by.items():
            if not self._island_full_for_all(key):
                candidates |= sessions
        fifo = self.policy == "fifo"
        bounds = []
        for sid in candidates:
            s = self._sessions[sid]
            oldest = min(q[0].id for q in s.queues.values())
            bounds.append(((oldest,) if fifo else (s.vtime, oldest), sid))
        bounds.sort()
        best: ScheduledRun | None = None
        best_key: tuple = ()
        for bound, sid in bounds:
            if best is not None and bound > best_key:
                break
            s = self._sessions[sid]
            run = self._next_of(sid, s)
            if run is None:
                continue
            key = (run.id,) if fifo else (s.vtime, run.id)
            if best is None or key < best_key:
                best, best_key = run, key
        return best

    def _next_of(self, sid: int, s: _Session) -> ScheduledRun | None:
        """The session's oldest run that heads the queue of every island it touches and
        whose islands all have room, if any."""
        found: ScheduledRun | None = None
        for queue in s.queues.values():
            head = queue[0]
            if found is not None and head.id >= found.id:
                continue
            if all(s.queues[k][0] is head for k in _keys(head)) and not any(
                    self._island_full(i, sid) for i in head.islands):
                found = head
        return found

    def _island_full(self, island: int, session: int) -> bool:
        # another session has runs queued for the island
        others = len(self._queued_by.get(island, ())) > (island in self._sessions[session].queues)
        return self._full(island, others)

    def _island_full_for_all(self, key: Hashable) -> bool:
        """Whether every session queued under ``key`` finds the island full (``_island_full``):
        with more than one queued, each has another beside it."""
        return key is not None and self._full(key, len(self._queued_by.get(key, ())) > 1)

    def _full(self, island: int, others_queued: bool) -> bool:
        """The window rule: an island at its window is full while other sessions have work
        queued for it, and past SOLO_FACTOR windows in any case."""
        load = self._island_load.get(island, 0)
        if load < self.window:
            return False
        return load >= self.window * SOLO_FACTOR or others_queued

    # ---- status ---------------------------------------------------------------------

    def inflight(self, island: int) -> int:
        return self._island_load.get(island, 0)

    def queued(self, island: int) -> int:
        return sum(len(s.queues.get(island, ())) for s in self._sessions.values())

    def session_stats(self, session: int) -> dict[str, Any]:
        s = self._sessions.get(session)
        if s is None:
            return {}
        return {"weight": s.weight, "queued": s.waiting, "inflight": s.inflight,
                "completed": s.completed, "device_seconds": s.device_seconds}


def _keys(run: ScheduledRun) -> Iterable[Hashable]:
    """The queues a run waits in: one per island it touches."""
    return run.islands or (None,)
