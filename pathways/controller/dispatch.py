"""Dispatch: runs go through the gang scheduler and out to their workers, in its order.

Released runs are sent to every worker involved (the op stream once per worker, then a
small ``RunProgram`` per call) from this one thread, so all workers see them in one global
order: the gang order that keeps collectives from deadlocking. Workers report each run
done (freeing its window slot and measuring device time for the proportional-share
policy) and, for sequentially dispatched programs, each node finished, which releases the
nodes after it. No I/O beyond outboxes.

A client submits without waiting, so while the window is full its op-by-op runs queue up
at the controller. Consecutive queued runs of one session on the same workers are
coalesced (``coalesce``): the first takes the later ones on, and they are dispatched
together, one window slot and one payload per worker, each still its own ``RunProgram``
(carrying the group's id) in the session's order. Every worker reports each of them done.
A group is bounded in runs and in expected device time, so that fair share between
sessions keeps its granularity.

Each island's progress is timed (the one clock here, injected): an island with runs in
flight that has finished none for longer than the run timeout is stuck (``stalled``), and
the core resets it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from pathways.controller.lowering import Lowered
from pathways.controller.membership import Membership, WorkerConn
from pathways.controller.scheduler import ScheduledRun, Scheduler
from pathways.protocol import messages as m
from pathways.timeline import RECORDER, now

MAX_COALESCED = 64  # runs dispatched together at most
# Expected seconds a coalesced group occupies its workers at most (its device seconds, which
# count every worker's, divided by the number of workers): the granularity of fair share.
COALESCE_SECONDS = 0.05


@dataclass
class Dispatch:
    """What a run sends to its workers, and the handles it defines for its session."""

    key: int
    lowered: Lowered
    nvalues: int
    base: int
    tbase: int
    args: dict[int, int]
    outputs: dict[int, int]  # output value -> handle (inputs passed through excluded)
    joined: list["Dispatch"] = field(default_factory=list)  # later runs sent with this one (coalesce)
    expected: float = 0.0  # coalesce: the expected device seconds of this run and those it took on
    waiting: dict[int, int] = field(default_factory=dict)  # worker -> its done reports still due
    seconds: float = 0.0
    unfinished: dict[int, set[int]] = field(default_factory=dict)  # sequential: node -> workers running it
    finished: set[int] = field(default_factory=set)  # sequential: nodes finished
    traced: bool = False  # record its steps (timeline.py)
    notify: bool = False  # tell the session when its outputs are computed (m.Computed)
    failed: bool = False  # a worker reported an output of it (or of a run joined to it) failed
    values: dict[int, bytes] = field(default_factory=dict)  # notify: small outputs' bytes, as reported
    since: int = 0  # traced: when its current step began (perf_counter_ns)

    @property
    def parts(self) -> list["Dispatch"]:
        """This run and those it took on, in the session's order."""
        return [self, *self.joined] if self.joined else [self]

    @property
    def told(self) -> list[int]:
        """The output handles of this run and those it took on that asked to be told when
        computed (notify)."""
        return [h for part in self.parts if part.notify for h in part.outputs.values()]


def coalesce(scheduler: Scheduler, tail: ScheduledRun | None, d: Dispatch) -> bool:
    """Have ``tail``, the session's latest submitted run, take ``d`` (the session's next
    run) on, where both can go out together: ``tail`` is still queued, neither waits at
    gates (sequential dispatch), both run on the same workers, and the group stays within
    its bounds. Returns whether it did."""
    if tail is None or not tail.queued:
        return False
    first: Dispatch = tail.payload
    a, b = first.lowered, d.lowered
    if (a.gates is not None or b.gates is not None or len(first.joined) + 1 >= MAX_COALESCED
            or (a is not b and a.ops.keys() != b.ops.keys())):
        return False
    if not first.joined:
        first.expected = scheduler.estimate(tail)
    expected = first.expected + scheduler.cost(d.key)
    if expected > COALESCE_SECONDS * len(b.ops):
        return False
    scheduler.join(tail, d.key)
    first.joined.append(d)
    first.expected = expected
    return True


class Dispatcher:
    """Sends released runs to their workers and takes their reports. ``clock`` (seconds,
    monotonic) times each island's progress: when a run was last finished or abandoned
    there, or dispatched to it while it had nothing in flight (``stalled``)."""

    def __init__(self, scheduler: Scheduler, membership: Membership,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.membership = membership
        self._clock = clock
        self._progress: dict[int, float] = {}  # island -> when it last made progress

    def progressed(self, runs: Iterable[ScheduledRun]) -> None:
        """``runs`` finished or were abandoned: their islands made progress."""
        now = self._clock()
        for run in runs:
            for island in run.islands:
                self._progress[island] = now

    def stalled(self, timeout: float) -> Iterator[tuple[int, ScheduledRun]]:
        """(island, its oldest run in flight) for each island with runs in flight that has
        made no progress for more than ``timeout`` seconds."""
        now = self._clock()
        for island, since in list(self._progress.items()):
            if now - since > timeout and self.scheduler.inflight(island):
                run = self.scheduler.oldest_in_flight(island)
                if run is not None:
                    yield island, run

    def release(self) -> Iterator[ScheduledRun]:
        """Send whatever the scheduler releases, in its order, to every worker involved;
        yields each run sent."""
        workers = self.membership.workers
        for run in self.scheduler.dispatchable():
            for island in run.islands:
                if self.scheduler.inflight(island) == 1:  # the island was idle: its clock starts now
                    self._progress[island] = self._clock()
            d: Dispatch = run.payload
            parts = d.parts
            d.waiting = dict.fromkeys(d.lowered.workers, len(parts))
            if d.lowered.gates is not None:
                d.unfinished = {n: set(ws) for n, ws in d.lowered.gates.steps.items()}
            for p in parts:
                if p.traced:
                    RECORDER.span("queue", p.since, p.base, f"run {run.id}", "queued runs")
                    p.since = now()
                go = m.RunProgram(run.id, p.key, p.base, p.tbase, p.args, p.traced, p.notify)
                for worker, ops in p.lowered.ops.items():
                    conn = workers[worker]
                    if p.key not in conn.defined:
                        conn.outbox.put(m.Define(p.key, run.session, p.nvalues, p.lowered.ncopies, tuple(ops)))
                        conn.defined.add(p.key)
                    conn.outbox.put(go)
                if p.traced:
                    RECORDER.span("dispatch", p.since, p.base, f"{len(p.lowered.ops)} worker(s)")
            yield run

    def done(self, conn: WorkerConn, reports: tuple[tuple[int, float], ...], failed: tuple[int, ...] = (),
             values: tuple[tuple[int, int, bytes], ...] = ()) -> list[ScheduledRun]:
        """Worker ``conn`` finished its part of the runs ``reports`` names (those in ``failed``
        with an output that failed there; ``values``: small outputs of theirs, kept where they
        are outputs of a part sent with notify); the runs that every worker has now finished."""
        finished = []
        for run_id, seconds in reports:
            run = self.scheduler.running(run_id)
            if run is None:
                continue
            d: Dispatch = run.payload
            due = d.waiting.get(conn.worker)
            if due is None:
                continue
            if failed and run_id in failed:
                d.failed = True
            if values:
                told = set(d.told)
                d.values.update((h, b) for r, h, b in values if r == run_id and h in told)
            # a worker reports the runs of a group in their order: this is the due-th from the end
            part = d.joined[-due] if due <= len(d.joined) else d
            began = now() if part.traced else 0
            if due > 1:
                d.waiting[conn.worker] = due - 1
            else:
                del d.waiting[conn.worker]
            d.seconds += seconds
            if not d.waiting:
                self.scheduler.finish(run.id, d.seconds)
                self.progressed((run,))
                finished.append(run)
            if part.traced:
                RECORDER.span("done", began, part.base, f"worker {conn.worker} reported it done")
        return finished

    def step(self, conn: WorkerConn, run_id: int, node: int) -> None:
        """A worker finished its part of ``node`` of a sequential run: release the nodes
        whose every predecessor has now finished."""
        run = self.scheduler.running(run_id)
        if run is None or run.payload.lowered.gates is None:
            return
        d: Dispatch = run.payload
        gates = d.lowered.gates
        left = d.unfinished.get(node)
        if left is None or conn.worker not in left:
            return
        left.discard(conn.worker)
        if left:
            return
        d.finished.add(node)
        go: dict[int, list[int]] = {}
        for succ in gates.succs.get(node, ()):
            if all(p in d.finished for p in gates.preds[succ]):
                for w in gates.waits.get(succ, ()):
                    go.setdefault(w, []).append(succ)
        self._send_go(run_id, go)

    def release_all(self, run: ScheduledRun, lost: set[int]) -> None:
        """A cancelled sequential run: let the surviving workers through its gates (their
        inputs are poisoned, so what they compute is too) instead of waiting forever."""
        gates = run.payload.lowered.gates
        if gates is None:
            return
        go: dict[int, list[int]] = {}
        for node, workers in gates.waits.items():
            for w in workers:
                if w not in lost:
                    go.setdefault(w, []).append(node)
        self._send_go(run.id, go)

    def _send_go(self, run_id: int, go: dict[int, list[int]]) -> None:
        """Release nodes of a sequential run: worker -> the nodes it may now run."""
        for w, nodes in go.items():
            conn = self.membership.workers.get(w)
            if conn is not None:
                conn.outbox.put(m.Go(run_id, tuple(nodes)))
