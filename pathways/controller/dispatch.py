"""Dispatch: runs go through the gang scheduler and out to their workers, in its order.

Released runs are sent to every worker involved (the op stream once per worker, then a
small ``RunProgram`` per call) from this one thread, so all workers see them in one global
order: the gang order that keeps collectives from deadlocking. Workers report each run
done (freeing its window slot and measuring device time for the proportional-share
policy) and, for sequentially dispatched programs, each node finished, which releases the
nodes after it. No I/O beyond outboxes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from pathways.controller.lowering import Lowered
from pathways.controller.membership import Membership, WorkerConn
from pathways.controller.scheduler import Run, Scheduler
from pathways.protocol import messages as m
from pathways.timeline import RECORDER, now


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
    waiting: set[int] = field(default_factory=set)  # workers yet to report the run done
    seconds: float = 0.0
    unfinished: dict[int, set[int]] = field(default_factory=dict)  # sequential: node -> workers running it
    finished: set[int] = field(default_factory=set)  # sequential: nodes finished
    traced: bool = False  # record its steps (timeline.py)
    since: int = 0  # traced: when its current step began (perf_counter_ns)


class Dispatcher:
    def __init__(self, scheduler: Scheduler, membership: Membership) -> None:
        self.scheduler = scheduler
        self.membership = membership

    def release(self) -> Iterator[Run]:
        """Send whatever the scheduler releases, in its order, to every worker involved;
        yields each run sent."""
        workers = self.membership.workers
        for run in self.scheduler.dispatchable():
            d: Dispatch = run.payload
            if d.traced:
                RECORDER.span("queue", d.since, d.base, f"run {run.id}", "queued runs")
                d.since = now()
            d.waiting = set(d.lowered.workers)
            if d.lowered.gates is not None:
                d.unfinished = {n: set(ws) for n, ws in d.lowered.gates.steps.items()}
            go = m.RunProgram(run.id, d.key, d.base, d.tbase, d.args, d.traced)
            for worker, ops in d.lowered.ops.items():
                conn = workers[worker]
                if d.key not in conn.defined:
                    conn.outbox.put(m.Define(d.key, run.session, d.nvalues, d.lowered.ncopies, tuple(ops)))
                    conn.defined.add(d.key)
                conn.outbox.put(go)
            if d.traced:
                RECORDER.span("dispatch", d.since, d.base, f"{len(d.lowered.ops)} worker(s)")
            yield run

    def done(self, conn: WorkerConn, reports: tuple[tuple[int, float], ...]) -> None:
        for run_id, seconds in reports:
            run = self.scheduler.running(run_id)
            if run is None:
                continue
            d: Dispatch = run.payload
            if d.traced:
                began = now()
            d.waiting.discard(conn.worker)
            d.seconds += seconds
            if not d.waiting:
                self.scheduler.finish(run.id, d.seconds)
            if d.traced:
                RECORDER.span("done", began, d.base, f"worker {conn.worker} reported it done")

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

    def release_all(self, run: Run, lost: set[int]) -> None:
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
