"""Op-by-op runs queued at the controller go out together: consecutive queued runs of one
session are coalesced into one dispatch (one window slot, one payload per worker), and
workers report a burst of runs done in a few messages. Pure controller logic here, and a
real worker core (JAX, no processes) for the reports."""

import time

import numpy as np
import pytest

from pathways.controller.core import ControllerCore
from pathways.controller.dispatch import COALESCE_SECONDS, MAX_COALESCED
from pathways.controller.scheduler import SOLO_FACTOR, ScheduledRun, Scheduler
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.errors import LOST
from pathways.protocol.handles import first_handle
from pathways.worker.executor import REPORT_BATCH
from tests.test_controller import Box, WorkerConn, _of, register, session
from tests.test_worker_core import SESSION, core, define_double, fetch, put, up  # noqa: F401 (fixtures)

BASE = first_handle(1)
FN, PROGRAM, SEQUENTIAL, DATA = BASE + 1, BASE + 2, BASE + 3, BASE + 4


def _cluster(window=1, hosts=1):
    """A core with one island of ``hosts`` workers, a session with a slice across them, and
    a program (one node, value 0 -> 1) defined twice: parallel and sequential dispatch."""
    core = ControllerCore(window=window)
    workers = register(core, hosts) if hosts == 1 else _island(core, hosts)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", hosts, None, 0, False)]))
    reply = _of(client, m.SliceReply)[0]
    layout = Layout(reply.workers, tuple((r, 0) for r in range(hosts)), (hosts,), ("x",), ("x",))
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[FN, [0], [1]]], "outputs": [1],
                           "types": [["float32", [hosts]]] * 2}, "graph")
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(FN, reply.slice, m.FunctionBody("f", b"x", (layout,), (layout,))),
        m.DefineProgram(PROGRAM, graph, "parallel"), m.DefineProgram(SEQUENTIAL, graph, "sequential"),
        m.PutNotice(DATA, layout)]))
    assert not _of(client, m.Error), client
    return core, workers, client


def _island(core, n):
    conns = [WorkerConn(Box()) for _ in range(n)]
    for i, conn in enumerate(conns):
        core.on_worker_batch(conn, m.encode_batch([m.Register(
            f"grpc://127.0.0.1:{i + 1}", f"tcp://127.0.0.1:{i + 1}", "cpu", 1, "isl", n, i, f"h:{9 + i}", 1, "h", 1 << 30)]))
    return conns


def _chain(core, n, start=100, program=PROGRAM, first=DATA):
    """``n`` runs of ``program``, each reading the previous one's output; their bases."""
    bases, arg = [], first
    for i in range(n):
        base = BASE + start + 10 * i
        core.on_session_batch(1, m.encode_batch([m.Run(program, base, {0: arg})]))
        bases.append(base)
        arg = base + 1
    return bases


def _done(core, conn, run_id, times=1, seconds=1e-4):
    core.on_worker_batch(conn, m.encode_batch([m.Done(((run_id, seconds),) * times)]))


def test_queued_runs_of_a_session_go_out_together_in_one_window_slot_and_in_order():
    core, (w0,), client = _cluster(window=1)
    solo = SOLO_FACTOR  # what a session alone may have in flight with a window of 1
    bases = _chain(core, solo + 10)
    sent = _of(w0.outbox, m.RunProgram)
    assert [r.base for r in sent] == bases[:solo], "up to the window, each run goes at once"
    assert core.scheduler.inflight(0) == solo and core.scheduler.queued(0) == 1, "the other 10 wait as one"
    w0.outbox.clear()
    _done(core, w0, sent[0].id)
    group = _of(w0.outbox, m.RunProgram)
    assert [r.base for r in group] == bases[solo:], "released together, in the session's order"
    assert len({r.id for r in group}) == 1, "one dispatch: every part carries the group's id"
    assert core.scheduler.inflight(0) == solo, "the group holds one window slot"
    _done(core, w0, group[0].id, times=9)
    assert core.scheduler.running(group[0].id) is not None, "done only once every part is reported"
    _done(core, w0, group[0].id)
    assert core.scheduler.running(group[0].id) is None
    assert core.scheduler.session_stats(1)["completed"] == 1 + 10, "every run counts as completed"
    assert not _of(client, m.Error) and not _of(client, m.Poisoned)


def test_a_group_is_bounded_in_runs_and_in_expected_device_time():
    core, (w0,), _ = _cluster(window=1)
    _chain(core, SOLO_FACTOR)
    _chain(core, MAX_COALESCED + 5, start=1000)
    assert core.scheduler.queued(0) == 2, "a group takes at most MAX_COALESCED runs"
    # a program measured slow is never coalesced: one run holds a fair share's worth of device time
    core, (w0,), _ = _cluster(window=1)
    first = _chain(core, 1)
    _done(core, w0, _of(w0.outbox, m.RunProgram)[0].id, seconds=2 * COALESCE_SECONDS)
    _chain(core, SOLO_FACTOR + 3, start=1000, first=first[0] + 1)
    assert core.scheduler.queued(0) == 3


def test_sequentially_dispatched_runs_are_never_coalesced():
    core, (w0,), _ = _cluster(window=1)
    _chain(core, SOLO_FACTOR + 3, program=SEQUENTIAL)
    assert core.scheduler.queued(0) == 3


def test_a_run_on_other_workers_or_after_the_group_left_the_queue_starts_a_new_one():
    core, (w0,), _ = _cluster(window=1)
    bases = _chain(core, SOLO_FACTOR + 2)
    _done(core, w0, _of(w0.outbox, m.RunProgram)[0].id)  # the queued group goes out
    assert core.scheduler.queued(0) == 0
    _chain(core, 1, start=1000, first=bases[-1] + 1)
    assert core.scheduler.queued(0) == 1, "the group was dispatched: the next run cannot join it"


def test_losing_a_worker_poisons_the_outputs_of_every_coalesced_run():
    core, (w0, w1), client = _cluster(window=1, hosts=2)
    bases = _chain(core, SOLO_FACTOR + 5)
    _done(core, w0, _of(w0.outbox, m.RunProgram)[0].id)
    _done(core, w1, _of(w1.outbox, m.RunProgram)[0].id)  # the first group of 5 flies now
    _chain(core, 3, start=1000, first=bases[-1] + 1)  # and 3 more queue as another group
    core.worker_lost(w1)
    poisoned = {h for p in _of(client, m.Poisoned) if p.kind == LOST for h in p.handles}
    assert {b + 1 for b in bases[SOLO_FACTOR:]} <= poisoned, "every part of the group in flight"
    assert {BASE + 1000 + 10 * i + 1 for i in range(3)} <= poisoned, "every part of the queued group"


def test_a_groups_measured_time_is_shared_among_its_programs_by_their_estimates():
    sched = Scheduler("fair", window=1)
    sched.add_session(1)
    sched._cost.update({"a": 1e-3, "b": 3e-3})
    first = sched.submit(ScheduledRun(1, frozenset({0}), "a"))
    sched.join(first, "b")
    assert sched.estimate(first) == pytest.approx(4e-3)
    assert list(sched.dispatchable()) == [first] and first.charged == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="no longer queued"):
        sched.join(first, "a")
    sched.finish(first.id, 8e-3)
    assert (sched.cost("a"), sched.cost("b")) == pytest.approx((2e-3, 6e-3))
    assert sched.session_stats(1)["device_seconds"] == pytest.approx(8e-3)


def test_a_burst_of_runs_is_reported_done_in_fewer_messages_than_runs(core, up):
    """A coalesced group as a worker receives it: a chain of runs with one id in one
    batch. Each is computed and reported exactly once, in order, in fewer messages."""
    define_double(core)
    x = first_handle(SESSION) + 100
    put(core, x, np.ones(3, dtype=np.float32))
    n, arg, runs = 4 * REPORT_BATCH, x, []
    for i in range(n):
        base = first_handle(SESSION) + 200 + 10 * i
        runs.append(m.RunProgram(9, 11, base, 0, {0: arg}))
        arg = base + 1
    core.on_batch(m.encode_batch(runs))
    header, value = fetch(core, arg)
    assert header["state"] == "ready"
    np.testing.assert_array_equal(value, np.full(3, 2.0 ** n, np.float32))
    end = time.monotonic() + 30.0
    while sum(len(d.runs) for d in up if type(d) is m.Done) < n and time.monotonic() < end:
        time.sleep(0.01)
    done = [d for d in up if type(d) is m.Done]
    assert [r for d in done for r, _ in d.runs] == [9] * n, "every run reported once"
    assert len(done) < n, "runs that followed each other were reported together"
