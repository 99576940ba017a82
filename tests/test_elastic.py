"""Elastic islands: a lost host is replaced and its island heals, from the same client
objects; the local supervisor restarts dead workers; a restarted controller is rejoined."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import free_port, status, stop_processes
from tests.conftest import child_of, pids_alive, read_line, wait_until


def _island(address, island=0):
    return next(i for i in status(address)["islands"] if i["island"] == island)


def _assembled(address, island=0):
    """Whether the island has all its hosts and is healthy (an island still assembling is not lost either)."""
    found = [i for i in status(address)["islands"] if i["island"] == island]
    return bool(found) and found[0]["healthy"] and not found[0]["assembling"]


def jax_psum(x):
    import jax
    return jax.lax.psum(x, "i")


def _kill(address, island, rank):
    w = next(w for w in status(address)["workers"] if w["island"] == island and w["rank"] == rank)
    os.kill(w["pid"], signal.SIGKILL)
    return w


@pytest.mark.parametrize("killed", [1, 0])  # rank 0 runs the island's coordination service
def test_a_killed_host_replaced_by_hand_heals_its_island_for_the_same_client_objects(killed):
    with pw.local_cluster(islands=[pw.Island(hosts=2)], restart_workers=False) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
        total = pw.pmap(lambda x: jax_psum(x) + 1.0, devices=s.devices, axis_name="i")
        np.testing.assert_array_equal(np.asarray(total(np.array([1.0, 2.0], np.float32))), [4.0, 4.0])
        # one half on each host: reading it needs the killed one (a block replicated on both
        # hosts is read from the first, which may answer before the island is declared lost)
        kept = pw.device_put(np.array([5.0, 6.0], np.float32), pw.NamedSharding(s.mesh("i"), pw.P("i")))
        kept.block_until_ready(timeout=60)
        survivor = next(w for w in status(c.address)["workers"] if w["rank"] == 1 - killed)
        addresses = s.addresses
        lost = _kill(c.address, 0, killed)
        with pytest.raises(pw.WorkerLostError):
            np.asarray(kept)
        # the surviving host's keeper (the process its launcher started) runs it again, and it joins the island
        wait_until(lambda: _island(c.address)["healing"] and _island(c.address)["hosts"] == 1,
                   what="the surviving host to restart and join its island again")
        keeper = c.pids[1 + 1 - killed]  # the survivor's keeper: the process its launcher started
        assert status(c.address)["workers"][0]["pid"] != survivor["pid"] and pids_alive([keeper]) == [keeper]
        replacement = subprocess.Popen(
            [sys.executable, "-m", "pathways", "worker", "--controller", c.address, "--platform", "cpu",
             "--devices", "1", "--island", "0", "--island-hosts", "2", "--launcher", "none"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PATHWAYS_WORKER_TOKEN": c.security.worker_token})  # the cluster's, which it drew
        try:
            # the session applies the move (SliceMoved) after status may report the heal
            wait_until(lambda: _assembled(c.address) and s.addresses != addresses, timeout=60,
                       what="the island to heal and the slice to follow it")
            workers = {w["rank"]: w for w in status(c.address)["workers"]}
            assert workers[killed]["pid"] == child_of(replacement.pid), "the replacement takes the free rank"
            assert workers[killed]["worker"] == lost["worker"] and workers[1 - killed]["worker"] == survivor["worker"], \
                "the hosts take the island's ranks under the worker ids of before"
            assert s.addresses == (workers[0]["address"], workers[1]["address"]), "the client's slice follows"
            # the same slice and compiled function, a fresh input: the psum runs over the healed island
            np.testing.assert_array_equal(np.asarray(total(np.array([3.0, 4.0], np.float32))), [8.0, 8.0])
            x = pw.device_put(np.array([1.0, 1.0], np.float32), s.devices)
            np.testing.assert_array_equal(np.asarray(total(x)), [3.0, 3.0])
            with pytest.raises(pw.WorkerLostError):
                np.asarray(kept)  # arrays that lived on the island stay lost
        finally:
            stop_processes([replacement])


def test_the_local_supervisor_restarts_a_killed_worker_and_the_island_heals():
    with pw.local_cluster(islands=[pw.Island(hosts=2), pw.Island(hosts=1)], restart_workers=True) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
        total = pw.pmap(lambda x: jax_psum(x) + 1.0, devices=s.devices, axis_name="i")
        np.testing.assert_array_equal(np.asarray(total(np.array([1.0, 2.0], np.float32))), [4.0, 4.0])
        before = list(c.pids)
        lost = _kill(c.address, 0, 0)  # rank 0 runs the island's coordinator
        addresses = s.addresses
        wait_until(lambda: not _island(c.address)["healthy"], what="the loss to be seen")
        wait_until(lambda: _assembled(c.address) and s.addresses != addresses, timeout=60,
                   what="the island to heal and the slice to follow it")
        assert c.restarts == 1 and c.pids[1:] != before[1:] and c.pids[2:] == before[2:], \
            "the supervisor started the dead worker again, and only it"
        assert lost["pid"] not in [w["pid"] for w in status(c.address)["workers"]]
        np.testing.assert_array_equal(np.asarray(total(np.array([3.0, 4.0], np.float32))), [8.0, 8.0])
        pids = list(c.pids)
    assert pids_alive(pids) == []


def test_a_read_that_began_at_a_healed_islands_old_address_follows_the_move():
    """A run sent just after its island healed is read by a client that may not have
    applied the island's SliceMoved yet: the read starts at the host's old address, dead,
    and the move comes while it waits. Here the slice is put back at its old address by
    hand, and the move applied again 1.5 s into the read: the read must follow it, not ask
    the dead address until its timeout."""
    with pw.local_cluster(islands=[pw.Island(hosts=1)], restart_workers=True) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)
        double = pw.jit(lambda x: x * 2.0, mesh=s.mesh("x"))
        np.testing.assert_array_equal(np.asarray(double(np.ones(2, np.float32))), [2.0, 2.0])
        old = (s.workers, s.addresses, s.island, s._physical)
        _kill(c.address, 0, 0)
        wait_until(lambda: s.addresses != old[1] and _assembled(c.address), timeout=60,
                   what="the island to heal and the slice to move")
        y = double(np.full(2, 3.0, np.float32))
        y.block_until_ready(timeout=60)
        new = (s.workers, s.addresses, s.island, s._physical)
        s.move(*old)  # as the slice was when a client that had not applied the move read it
        mover = threading.Timer(1.5, s.move, new)
        mover.start()
        try:
            started = time.monotonic()
            np.testing.assert_array_equal(y.to_numpy(timeout=30), [6.0, 6.0])
            assert time.monotonic() - started < 8, "the read waited out a verdict at the dead address"
        finally:
            mover.cancel()

def test_a_restarted_controller_is_rejoined_by_its_workers_and_old_clients_fail_fast():
    procs = []

    def controller(bind):
        p = subprocess.Popen([sys.executable, "-m", "pathways", "controller", "--bind", bind],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(p)
        return p, read_line(p)

    try:
        for _ in range(3):  # a free port may be taken by another process before the controller binds it
            bind = f"127.0.0.1:{free_port()}"
            first, line = controller(bind)
            if line:
                break
        address = f"grpc://{bind}"
        assert line.split()[-1] == address
        workers = [subprocess.Popen([sys.executable, "-m", "pathways", "worker", "--controller", address,
                                     "--platform", "cpu", "--island", "0", "--island-hosts", "2",
                                     "--launcher", "none", "--reconnect-timeout", "60"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
        procs.extend(workers)
        wait_until(lambda: _assembled(address), timeout=60, what="the island to assemble")
        old = pw.connect(address)
        try:
            s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
            slow = pw.jit(lambda x: _slow(x), mesh=s.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
            x = np.ones((512, 256), np.float32)
            slow(x).block_until_ready(timeout=120)  # compiled and warm
            pending = [slow(x) for _ in range(2)]  # a second or more each
            first.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            for out in pending:
                with pytest.raises(pw.ControllerLostError, match="restart it or call pw.connect"):
                    out.block_until_ready(timeout=60)
            assert time.monotonic() - killed < 10, "the old client's futures fail within seconds"
        finally:
            old.close()
        first.wait(timeout=10)
        assert controller(bind)[1].split()[-1] == address
        wait_until(lambda: len(status(address)["workers"]) == 2 and _assembled(address), timeout=90,
                   what="the workers to attach to the restarted controller")
        assert pids_alive([w.pid for w in workers]) == [w.pid for w in workers], "the workers kept their processes"
        new = pw.connect(address)
        try:
            t = pw.make_virtual_device_set().add_slice(cpu_devices=2)
            total = pw.pmap(lambda x: jax_psum(x), devices=t.devices, axis_name="i")
            np.testing.assert_array_equal(np.asarray(total(np.array([1.0, 2.0], np.float32))), [3.0, 3.0])
        finally:
            new.close()
    finally:
        stop_processes(procs)


def _slow(x):
    import jax
    w = jax.numpy.eye(x.shape[-1], dtype=x.dtype) * 0.5
    return jax.lax.fori_loop(0, 1000, lambda i, y: jax.numpy.tanh(y @ w) + y, x)
