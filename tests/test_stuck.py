"""Stuck hosts: a run that an island does not finish within the run timeout fails with
DeadlineExceededError naming the hosts that had not finished it, those hosts write their
threads' stacks to their logs, and the island is reset (its hosts restart) and serves
again. So is an island whose group broke in a collective (a host stopped past the
collectives' bound). The core's timing is tested with a clock that jumps; real two-host
islands stuck in a collective, and broken in one, are tested end to end."""

import os
import signal
import time

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from pathways.controller.core import ControllerCore
from pathways.controller.healing import BROKEN_GRACE_SECONDS
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from tests.conftest import wait_until
from tests.test_assembly import _register
from tests.test_controller import Box, _of

RUN_TIMEOUT = 5.0
STUCK_SECONDS = 6.0  # the real cluster's run timeout


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stuck_cluster_core():
    """A core with a run timeout, an island "pair" of two hosts and an island "one" of one,
    and a session with a program on the pair."""
    clock = Clock()
    core = ControllerCore(run_timeout=RUN_TIMEOUT, clock=clock)
    rank0, rank1 = _register(core, "pair", 2, rank=0, coordinator="h0:1"), _register(core, "pair", 2, rank=1)
    single = _register(core, "one", 1, coordinator="h2:1")
    sid, client = 1, Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0),
                                               m.SliceRequest(1, "cpu", 2, None, 0, False)]))
    [pair] = _of(client, m.SliceReply)
    halves = Layout(pair.workers, ((0, 0), (1, 0)), (2,), ("i",), ("i",))
    f, program, data = (first_handle(sid) + i for i in (1, 2, 3))
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[f, [0], [1]]], "outputs": [1],
                           "types": [["float32", [2]]] * 2}, "graph")
    core.on_session_batch(sid, m.encode_batch([
        m.DefineFunction(f, pair.slice, m.FunctionBody("f", b"x", (halves,), (halves,))),
        m.DefineProgram(program, graph, "parallel"), m.PutNotice(data, halves)]))
    return core, clock, (rank0, rank1, single), sid, client, (program, data)


def _done(core, conn, run_id):
    core.on_worker_batch(conn, m.encode_batch([m.Done(((run_id, 0.1),))]))


def test_an_island_that_finishes_no_run_within_the_timeout_is_reset_and_names_the_hosts_behind():
    core, clock, (rank0, rank1, single), sid, client, (program, data) = _stuck_cluster_core()
    first, second = first_handle(sid) + 100, first_handle(sid) + 200
    core.on_session_batch(sid, m.encode_batch([m.Run(program, first, {0: data}), m.Run(program, second, {0: data})]))
    runs = [x.id for x in _of(rank0.outbox, m.RunProgram)]
    assert len(set(runs)) == 2, "both runs are in flight"

    # the clock runs from the island's last progress, not from each run's dispatch: the second
    # run waited behind the first, and only its own time counts
    clock.now += RUN_TIMEOUT - 1
    core.check_stuck_runs()
    _done(core, rank0, runs[0])
    _done(core, rank1, runs[0])
    clock.now += RUN_TIMEOUT - 1
    core.check_stuck_runs()
    assert not [x for x in rank0.outbox if type(x) is m.Reset] and not _of(client, m.Poisoned)

    _done(core, rank0, runs[1])  # rank 1 never finishes it: stuck in the collective, or before it
    clock.now += 1.5
    core.check_stuck_runs()
    [stuck] = [x for x in _of(client, m.Poisoned) if second + 1 in x.handles]
    assert stuck.kind == "DeadlineExceededError"
    assert f"run {runs[1]} did not finish within the run timeout of 5 s" in stuck.message
    assert rank1.describe() in stuck.message and rank0.describe() not in stuck.message, stuck.message
    assert "reset" in stuck.message and "restart" in stuck.message
    # both hosts restart; the one that had not finished first writes its threads' stacks
    assert [(x.stacks, "reset" in x.reason) for x in _of(rank0.outbox, m.Reset)] == [(False, True)]
    assert [(x.stacks, "reset" in x.reason) for x in _of(rank1.outbox, m.Reset)] == [(True, True)]
    assert not _of(single.outbox, m.Reset), "the other island keeps serving"
    # the array on the island is gone with it; the first run's result too
    gone = {h: x.kind for x in _of(client, m.Poisoned) for h in x.handles}
    assert gone[data] == gone[first + 1] == "WorkerLostError"
    pair = next(i for i in core.status().as_dict()["islands"] if i["name"] == "pair")
    assert not pair["healthy"] and "reset" in str(pair), pair
    core.check_stuck_runs()  # nothing is in flight there any more: nothing more happens
    assert len(_of(rank1.outbox, m.Reset)) == 1

    # the hosts rejoin as new processes, and the island runs again
    _register(core, "pair", 2, rank=0, coordinator="h0:2")
    again = _register(core, "pair", 2, rank=1)
    assert next(i for i in core.status().as_dict()["islands"] if i["name"] == "pair")["healthy"]
    core.on_session_batch(sid, m.encode_batch([m.PutNotice(data + 1, Layout(
        (rank0.worker, rank1.worker), ((0, 0), (1, 0)), (2,), ("i",), ("i",)), 1),
        m.Run(program, first_handle(sid) + 300, {0: data + 1})]))
    assert _of(again.outbox, m.RunProgram), "the island runs again"


def test_without_a_run_timeout_a_run_may_take_as_long_as_it_takes():
    core, clock, (rank0, rank1, _), sid, client, (program, data) = _stuck_cluster_core()
    core.run_timeout = None
    core.on_session_batch(sid, m.encode_batch([m.Run(program, first_handle(sid) + 100, {0: data})]))
    clock.now += 1e6
    core.check_stuck_runs()
    assert not _of(client, m.Poisoned) and not _of(rank0.outbox, m.Reset)


def test_an_island_whose_group_broke_in_a_collective_is_reset_after_a_grace_even_once_its_run_ended():
    core, clock, (rank0, rank1, single), sid, client, (program, data) = _stuck_cluster_core()
    out = first_handle(sid) + 100
    core.on_session_batch(sid, m.encode_batch([m.Run(program, out, {0: data})]))
    [run] = {x.id for x in _of(rank0.outbox, m.RunProgram)}
    # heard only from a host of a run in flight: another island's host, or a run of no such
    # id, changes nothing
    core.on_worker_batch(single, m.encode_batch([m.GroupBroken(run, "not its run")]))
    core.on_worker_batch(rank0, m.encode_batch([m.GroupBroken(run + 7, "no such run")]))
    clock.now += 10 * BROKEN_GRACE_SECONDS
    core.check_broken_groups()
    assert not _of(rank0.outbox, m.Reset) and not _of(single.outbox, m.Reset)

    broke = "f on worker 0 failed in a collective: Gloo context initialization failed: timed out"
    core.on_worker_batch(rank0, m.encode_batch([m.GroupBroken(run, broke)]))
    core.on_worker_batch(rank1, m.encode_batch([m.GroupBroken(run, "said twice: heard once")]))
    _done(core, rank0, run)  # both hosts gave the run up: it ended, but gloo keeps the failed group
    _done(core, rank1, run)
    clock.now += BROKEN_GRACE_SECONDS - 0.1
    core.check_broken_groups()
    assert not _of(rank0.outbox, m.Reset), "within the grace, a loss may still explain it"
    clock.now += 0.2
    core.check_broken_groups()
    for conn in (rank0, rank1):
        [reset] = _of(conn.outbox, m.Reset)
        assert f"because its group broke: {broke}" in reset.reason and "restart" in reset.reason, reset.reason
    assert not _of(single.outbox, m.Reset), "the other island keeps serving"
    gone = {h: x for x in _of(client, m.Poisoned) for h in x.handles}
    assert gone[data].kind == "WorkerLostError" and "its group broke" in gone[data].message
    pair = next(i for i in core.status().as_dict()["islands"] if i["name"] == "pair")
    assert not pair["healthy"] and "reset" in str(pair), pair
    clock.now += 10 * BROKEN_GRACE_SECONDS
    core.check_broken_groups()
    assert len(_of(rank0.outbox, m.Reset)) == 1, "reset once"


def test_a_loss_within_the_grace_is_the_error_that_stands_and_the_island_healed_since_is_not_reset():
    core, clock, (rank0, rank1, _), sid, client, (program, data) = _stuck_cluster_core()
    core.on_session_batch(sid, m.encode_batch([m.Run(program, first_handle(sid) + 100, {0: data})]))
    [run] = {x.id for x in _of(rank0.outbox, m.RunProgram)}
    core.on_worker_batch(rank1, m.encode_batch([m.GroupBroken(run, "gloo: connection reset by peer")]))
    core.worker_lost(rank0, error="connection reset")  # killed: its peer's collective broke as it went
    [reset] = _of(rank1.outbox, m.Reset)
    assert rank0.describe() in reset.reason and "broke" not in reset.reason, reset.reason
    # the island heals within the grace (its hosts restart fast): the new group is not reset
    again = _register(core, "pair", 2, rank=0, coordinator="h0:2"), _register(core, "pair", 2, rank=1)
    clock.now += BROKEN_GRACE_SECONDS + 1
    core.check_broken_groups()
    assert not any(_of(conn.outbox, m.Reset) for conn in again)
    assert next(i for i in core.status().as_dict()["islands"] if i["name"] == "pair")["healthy"]
    assert all("broke" not in x.message for x in _of(client, m.Poisoned))


def test_through_the_ifrt_proxy_a_stuck_run_is_deadline_exceeded_and_a_lost_host_data_loss():
    from pathways.ifrt import types as t

    assert t.runtime_failure(pw.DeadlineExceededError("run 2 did not finish")).code == t.DEADLINE_EXCEEDED
    assert t.runtime_failure(pw.WorkerLostError("gone")).code == t.DATA_LOSS
    assert t.runtime_failure(pw.RemoteError("bad")).code == t.INTERNAL


# ---- a real island stuck in a collective ------------------------------------------------------

def test_a_host_stuck_before_a_collective_fails_the_run_within_the_timeout_and_the_island_serves_again(capfd):
    # started here, so that its workers' stderr is the test's, where their stacks are looked for
    # long enough for the first run's compile on a busy machine, which counts as the run's time
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1)], run_timeout=STUCK_SECONDS) as cluster:
        _stuck_and_healed(cluster)
    err = capfd.readouterr().err
    assert "stacks of this worker's threads" in err and "Thread 0x" in err, err[-3000:]


def _stuck_and_healed(cluster):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2)

    def spin_then_sum(x):
        # a host whose value is below 1 loops for ever; its peer waits for it in the psum
        looped = jax.lax.while_loop(lambda v: v < 1.0, lambda v: v * 0.5, x)
        return jax.lax.psum(looped, "i")

    total = pw.pmap(spin_then_sum, devices=s.devices, axis_name="i")
    np.testing.assert_array_equal(np.asarray(total(np.array([2.0, 3.0], np.float32))), [5.0, 5.0])
    workers = {w["worker"]: w for w in status(cluster.address)["workers"]}
    addresses = s.addresses

    started = time.monotonic()
    stuck = total(np.array([0.5, 3.0], np.float32))  # host 0 never leaves its loop
    with pytest.raises(pw.DeadlineExceededError,
                       match=f"did not finish within the run timeout of {STUCK_SECONDS:g} s") as info:
        np.asarray(stuck)
    assert time.monotonic() - started < STUCK_SECONDS + 10.0
    message = str(info.value)
    assert "reset" in message and any(f"worker {w} " in message for w in workers), message

    # and the session has applied the move (SliceMoved) that status may report before it: a
    # put to the hosts' old addresses would be lost
    wait_until(lambda: status(cluster.address)["islands"][0]["healthy"] and s.addresses != addresses, timeout=120,
               what="the island's hosts to restart and join it again, and the slice to follow them")
    np.testing.assert_array_equal(np.asarray(total(np.array([2.0, 3.0], np.float32))), [5.0, 5.0])
    assert {w["pid"] for w in status(cluster.address)["workers"]}.isdisjoint(w["pid"] for w in workers.values()), \
        "both hosts were restarted"


# ---- a real island whose group broke ------------------------------------------------------------

def test_a_host_stopped_past_the_collectives_bound_fails_the_run_and_its_island_restarts_and_serves_again():
    """A host stopped (SIGSTOP) before its island's first collective, for longer than the
    collectives wait for their peers (gloo: 30 s): its peer's run fails with WorkerLostError
    saying so, and the island, whose group that failure broke for good, restarts its hosts
    and serves again, with no run timeout set."""
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1)]) as cluster:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
        total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices, axis_name="i")
        # both hosts' JAX backends are up (they form the group's topology together, which a
        # host stopped meanwhile would hold up for minutes): an array put on both, read back
        np.testing.assert_array_equal(np.asarray(pw.device_put(np.array([3.0, 4.0], np.float32), s.devices)),
                                      [3.0, 4.0])
        workers, addresses = status(cluster.address)["workers"], s.addresses
        stopped = next(w["pid"] for w in workers if w["rank"] == 1)  # not the group's coordinator
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            # or, on a busy machine, the loss of a host that JAX's distributed service ended
            # meanwhile (it ends the hosts of a group one of whose hosts stopped answering it,
            # within about two minutes)
            with pytest.raises(pw.WorkerLostError,
                               match="failed in a collective with the other hosts of its island|was lost"):
                np.asarray(total(np.array([3.0, 4.0], np.float32)))
            assert time.monotonic() - started < 200.0
        finally:
            os.kill(stopped, signal.SIGCONT)
        wait_until(lambda: {w["pid"] for w in status(cluster.address)["workers"]}.isdisjoint(
            w["pid"] for w in workers) and status(cluster.address)["islands"][0]["healthy"]
            and s.addresses != addresses, timeout=120,
            what="the island's hosts to restart and join it again, and the slice to follow them")
        np.testing.assert_array_equal(np.asarray(total(np.array([3.0, 4.0], np.float32))), [7.0, 7.0])
