"""Silent peers: a frozen worker (SIGSTOP) is slow, not lost (its connection is open and its
host acknowledges): its island's runs fail by the run timeout, naming the host, and only
its island's work fails; healthy islands keep serving meanwhile; a dead or frozen
controller fails every client call within seconds, and the workers of a frozen one wait for
it. (A worker cut off the network is lost within the heartbeat bound: test_slow.py.)

Real processes on loopback clusters. Every stopped process is continued in a ``finally``
so that the cluster's cleanup can reap it."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from tests.conftest import child_of, live_processes, pids_alive, wait_until

# The clusters' heartbeat timeout: shorter than the default (10 s), so that the tests wait
# seconds, and long enough that a busy machine does not lose a host it should keep.
HEARTBEAT_TIMEOUT = 3.0
# How long a test allows for something the runtime bounds by the heartbeat timeout or gRPC
# keepalive (about 8 s), with room for a busy machine.
BOUND = 15.0
# What bounds a frozen worker's runs: long enough for the first runs' compiles on a busy machine.
RUN_TIMEOUT = 10.0


def steps(x):
    w = jax.numpy.eye(x.shape[-1], dtype=x.dtype) * 0.5
    return jax.lax.fori_loop(0, 100, lambda i, y: jax.numpy.tanh(y @ w) + y, x)


def test_a_frozen_worker_is_slow_its_runs_fail_by_the_run_timeout_and_healthy_islands_keep_serving():
    """``heartbeat_timeout`` reaches the controller and the workers: idle for longer than it,
    heartbeats alone keep every island healthy. Then one host of the two-host island 0 is
    stopped: past the heartbeat timeout it is slow, not lost (status says so, its island
    stays healthy), while island 1 keeps completing programs of the same client; its
    island's pending futures fail once the run timeout passes, the oldest with
    DeadlineExceededError naming the stopped host, the rest with WorkerLostError as the
    island is reset; a run on island 1 that needs island 0's data fails with it."""
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=1)],
                          heartbeat_timeout=HEARTBEAT_TIMEOUT, run_timeout=RUN_TIMEOUT) as c:
        vds = pw.make_virtual_device_set()
        doomed = vds.add_slice(cpu_devices=2, island=0)
        safe = vds.add_slice(cpu_devices=1, island=1)
        heavy = pw.jit(steps, mesh=doomed.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
        light = pw.jit(lambda x: x * 3, mesh=safe.mesh("x"))
        fetch = pw.program(lambda v: light(v))  # island 0's array moved to island 1, then computed on
        there = pw.device_put(np.arange(4, dtype=np.float32), pw.NamedSharding(doomed.mesh("x"), pw.P("x")))
        x = np.ones((2, 256), np.float32)
        heavy(x).block_until_ready(timeout=120)  # compiled and warm, like everything below
        np.testing.assert_array_equal(fetch(there).to_numpy(timeout=60), [0.0, 3.0, 6.0, 9.0])
        np.testing.assert_array_equal(light(np.ones(2, np.float32)).to_numpy(timeout=60), [3.0, 3.0])
        time.sleep(HEARTBEAT_TIMEOUT * 1.5)  # idle: heartbeats alone keep everyone attached
        assert all(i["healthy"] for i in status(c.address)["islands"])

        workers = status(c.address)["workers"]
        frozen = next(w for w in workers if w["island"] == 0 and w["rank"] == 1)
        pending = [heavy(x) for _ in range(3)]
        os.kill(frozen["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            # the client's programs on island 1 complete during the stall, past the heartbeat timeout
            done = 0
            while time.monotonic() - stopped < HEARTBEAT_TIMEOUT * 1.5:
                np.testing.assert_array_equal(light(np.full(2, done, np.float32)).to_numpy(timeout=5), [3.0 * done] * 2)
                done += 1
            assert done >= 3, f"only {done} programs completed on the healthy island during the stall"
            st = status(c.address)
            if time.monotonic() - stopped < RUN_TIMEOUT * 0.9:  # not reset by the run timeout yet
                assert st["islands"][0]["healthy"], st["islands"][0]
                slow = next(w["slow"] for w in st["workers"] if w["worker"] == frozen["worker"])
                assert slow is not None and slow >= HEARTBEAT_TIMEOUT, st["workers"]

            moved = fetch(there)  # needs the frozen host's half of `there`
            failures = []
            for out in [*pending, moved]:
                with pytest.raises((pw.DeadlineExceededError, pw.WorkerLostError)) as e:
                    out.block_until_ready(timeout=120)
                failures.append((time.monotonic() - stopped, e.value))
            slowest = max(t for t, _ in failures)
            print(f"\nfrozen worker: futures failed {slowest:.1f} s after SIGSTOP "
                  f"(heartbeat timeout {HEARTBEAT_TIMEOUT:g} s, run timeout {RUN_TIMEOUT:g} s)")
            assert RUN_TIMEOUT * 0.9 < slowest < RUN_TIMEOUT + BOUND, failures
            [stuck] = [e for _, e in failures if isinstance(e, pw.DeadlineExceededError)]
            assert f"did not finish within the run timeout of {RUN_TIMEOUT:g} s" in str(stuck), stuck
            assert f"worker {frozen['worker']} on host {frozen['host']} at {frozen['address']}" in str(stuck), stuck
            assert "while its host still acknowledged" in str(stuck), "the error says the host was slow"
            for _, error in failures:
                assert "stopped answering" not in str(error), "slow is not lost: the run timeout ended it"

            island = status(c.address)["islands"][0]
            assert not island["healthy"] and "reset" in str(island), island
            cli = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", c.address],
                                 capture_output=True, text=True, timeout=60)
            assert re.search(r"island 0: (UNHEALTHY|HEALING) \(", cli.stdout), cli.stdout
            assert "island 1: healthy" in cli.stdout
            np.testing.assert_array_equal(light(np.ones(2, np.float32)).to_numpy(timeout=30), [3.0, 3.0])
        finally:
            os.kill(frozen["pid"], signal.SIGCONT)
        # the continued worker reads the reset, restarts, and joins its island again: it heals
        wait_until(lambda: status(c.address)["islands"][0]["healthy"], timeout=60, what="the island to heal")
        assert frozen["pid"] not in [w["pid"] for w in status(c.address)["workers"]]


def _blocked(call):
    """Run ``call`` on a thread; returns a list that receives (seconds, exception) once it ends."""
    box, start = [], time.monotonic()

    def run():
        try:
            call()
            box.append((time.monotonic() - start, None))
        except Exception as e:  # the test asserts on it
            box.append((time.monotonic() - start, e))

    threading.Thread(target=run, daemon=True).start()
    return box


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_frozen_controller_fails_every_pending_call_within_seconds(sig):
    with pw.local_cluster(hosts=1, devices_per_host=1, heartbeat_timeout=HEARTBEAT_TIMEOUT) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        slow = pw.jit(lambda x: jax.lax.fori_loop(0, 1 << 30, lambda i, y: jax.numpy.tanh(y) + 1e-9, x),
                      mesh=s.mesh("d"))
        quick = pw.jit(lambda x: x + 1, mesh=s.mesh("d"))
        assert float(quick(np.float32(1)).to_numpy(timeout=60)) == 2.0
        pending = slow(np.float32(0))  # runs far longer than the test
        blocked = _blocked(lambda: pending.block_until_ready(timeout=120))
        time.sleep(1.0)
        assert blocked == [], "the computation should still be running"
        controller, workers = c.pids[0], c.pids[1:]
        first = {keeper: child_of(keeper) for keeper in workers}  # the worker each keeper runs
        os.kill(controller, sig)
        killed = time.monotonic()
        try:
            wait_until(lambda: blocked, timeout=BOUND + 5, what="the blocked call to end")
            seconds, error = blocked[0]
            elapsed = time.monotonic() - killed
            print(f"\ncontroller {sig.name}: a blocked call ended after {elapsed:.1f} s with {error!r}")
            assert isinstance(error, pw.ControllerLostError), error
            assert elapsed < BOUND
            with pytest.raises(pw.ControllerLostError, match=f"controller at {c.address}"):
                pending.to_numpy(timeout=5)
            with pytest.raises(pw.ControllerLostError):
                pw.make_virtual_device_set().add_slice(cpu_devices=1)
            if sig == signal.SIGSTOP:
                assert "stopped answering" in str(error), error
                # slow, not lost: the stopped controller's host still acknowledges what the workers
                # send, so they wait for it past their heartbeat timeout instead of restarting
                time.sleep(HEARTBEAT_TIMEOUT * 2)
                assert not any(_restarted(w, first[w]) for w in workers), "a worker gave the controller up"
                assert pids_alive(workers) == workers
        finally:
            if sig == signal.SIGSTOP:
                os.kill(controller, signal.SIGCONT)
        if sig == signal.SIGSTOP:  # continued, the controller still has every worker, in the same processes
            wait_until(lambda: sorted(w["pid"] for w in status(c.address)["workers"]) == sorted(first.values()),
                       timeout=30, what="the continued controller to list its workers")


def _restarted(keeper, first):
    """Whether process ``keeper`` runs a worker other than ``first``: its worker exited to
    attach again, and the keeper started the next, which waits for the controller."""
    return any(int(fields[1]) == keeper and pid != first for pid, fields in live_processes())
