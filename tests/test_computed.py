"""Outputs computed, as the controller tells a session (m.Computed): the session's record of
them (client/computed.py), and the controller's part (a run sent with ``notify`` is reported
once every worker has finished it, failed if any worker reported an output failed). The
front end's use of it, a wait for a jit output that asks no worker, is tested with a real
proxy client in tests/test_ifrt_server.py, and a failed output in tests/test_quota.py."""

import threading
import time

from pathways.client.computed import MAX_EXPECTED, MAX_VALUE_BYTES, Computations
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from tests.test_controller import _of
from tests.test_stuck import _done, _stuck_cluster_core


def test_a_wait_returns_once_every_output_is_computed_and_false_once_one_failed():
    c = Computations()
    assert c.expect([1, 2, 3])
    assert c.wait([1, 2], 0.01) is None, "still running at the deadline"
    threading.Timer(0.05, c.computed, ([1, 2], True)).start()
    began = time.monotonic()
    assert c.wait([1, 2], 10.0) is True
    assert time.monotonic() - began < 5.0
    c.computed([3], False)
    assert c.wait([1, 3], 10.0) is False


def test_a_wait_for_outputs_not_kept_says_it_does_not_know():
    c = Computations()
    c.expect([1])
    c.computed([1, 99], True)  # 99 was never expected: ignored
    assert c.wait([99], 10.0) is None
    c.forget(1)  # released
    assert c.wait([1], 10.0) is None
    c.expect([2])
    threading.Timer(0.05, c.close).start()
    assert c.wait([2], 10.0) is None, "a closed session's waits end"
    assert not c.expect(range(MAX_EXPECTED + 1)), "beyond the bound nothing more is kept"


def test_small_values_are_kept_for_expected_outputs_within_a_bound_until_released():
    c = Computations()
    c.expect([1, 2, 3])
    c.computed([1, 2, 3, 4], True, [(1, b"one"), (4, b"never expected"), (2, b"x" * MAX_VALUE_BYTES)])
    assert c.value(1) == b"one" and c.value(4) is None
    assert c.value(2) is None, "past the bound: read from the workers"
    c.forget(1)
    assert c.value(1) is None
    c.computed([3], True, [(3, b"y" * MAX_VALUE_BYTES)])
    assert c.value(3) is not None, "the bytes released make room again"


def test_the_controller_says_a_notify_runs_outputs_are_computed_once_every_worker_finished_it():
    core, _, (rank0, rank1, _), sid, client, (program, data) = _stuck_cluster_core()
    quiet, told, broken = (first_handle(sid) + base for base in (100, 200, 300))
    core.on_session_batch(sid, m.encode_batch([m.Run(program, quiet, {0: data}),
                                               m.Run(program, told, {0: data}, notify=True),
                                               m.Run(program, broken, {0: data}, notify=True)]))
    runs = sorted({x.id for x in _of(rank0.outbox, m.RunProgram)})
    assert len(runs) == 3, runs
    for run in runs:
        _done(core, rank0, run)
    assert not _of(client, m.Computed), "not before every worker has finished"
    _done(core, rank1, runs[0])
    _done(core, rank1, runs[1])
    core.on_worker_batch(rank1, m.encode_batch([m.Done(((runs[2], 0.1),), (runs[2],))]))
    # the program's one output is value 1: the run's handle base + 1
    assert _of(client, m.Computed) == [m.Computed((told + 1,), False), m.Computed((broken + 1,), True)]


def test_the_controller_passes_on_the_small_values_of_a_notify_runs_own_outputs_only():
    core, _, (rank0, rank1, _), sid, client, (program, data) = _stuck_cluster_core()
    told = first_handle(sid) + 100
    core.on_session_batch(sid, m.encode_batch([m.Run(program, told, {0: data}, notify=True)]))
    [run] = {x.id for x in _of(rank0.outbox, m.RunProgram)}
    assert [x.notify for x in _of(rank0.outbox, m.RunProgram)] == [True]
    other = first_handle(sid) + 999  # not an output of the run: a worker cannot make the session believe it
    core.on_worker_batch(rank0, m.encode_batch([m.Done(((run, 0.1),), (), ((run, told + 1, b"ab"), (run, other, b"no"),
                                                                          (run + 1, told + 1, b"wrong run")))]))
    _done(core, rank1, run)
    assert _of(client, m.Computed) == [m.Computed((told + 1,), False, ((told + 1, b"ab"),))]
