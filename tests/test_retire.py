"""`pathways retire` against real clusters: a stopped one-host island no longer stays
UNHEALTHY in status for good, and retiring a healthy island shuts its worker down (its
keeper exits, nothing restarts it) while the session that had a slice there is told why.
The core's logic, draining included, is tested without processes in
tests/test_controller_retire.py."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pathways as pw
from pathways import cluster
from pathways.cluster import RESTART_FIRST_PAUSE
from pathways.wire.security import Security
from tests.conftest import child_of, pids_alive, wait_until

TOKEN = "retire-test-token"


def _island(address, name, security=None):
    return next((i for i in cluster.status(address, security=security)["islands"] if i["name"] == name), None)


def _cli(*args, token_file=None):
    env = {k: v for k, v in os.environ.items() if k != "PATHWAYS_TOKEN"}
    flags = ["--token-file", token_file] if token_file else []
    return subprocess.run([sys.executable, "-m", "pathways", "retire", *args, *flags], capture_output=True,
                          text=True, timeout=120, env=env)


def test_a_stopped_one_host_island_is_retired_with_the_token_and_the_other_keeps_serving(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    security = Security(token=TOKEN)
    with pw.local_cluster(islands=[pw.Island(1, 1), pw.Island(1, 1)], security=security,
                          restart_workers=False) as c:  # a stopped host that stays stopped
        keeper = c.pids[2]  # island 1's host: its keeper, whose child is the worker
        worker = child_of(keeper)
        address = next(w["address"] for w in cluster.status(c.address, security=security)["workers"]
                        if w["pid"] == worker)
        os.kill(worker, signal.SIGKILL)
        os.kill(keeper, signal.SIGKILL)
        wait_until(lambda: not _island(c.address, "1", security)["healthy"], what="the island's loss to be seen")

        refused = _cli("--address", c.address, "1")
        assert refused.returncode == 1 and "token" in refused.stderr, refused
        assert _island(c.address, "1", security) is not None, "a request without the token changes nothing"

        out = _cli("--address", c.address, "1", token_file=str(token_file))
        assert out.returncode == 0, out.stderr
        assert "forgot lost island 1" in out.stdout, out.stdout
        assert [i["name"] for i in cluster.status(c.address, security=security)["islands"]] == ["0"]

        again = _cli("--address", c.address, "1", token_file=str(token_file))
        assert again.returncode == 1 and "no island is named '1'" in again.stderr, again
        gone = _cli("--address", c.address, "--host", address, token_file=str(token_file))
        assert gone.returncode == 1 and f"no worker serves at {address}" in gone.stderr, gone
        both = _cli("--address", c.address, "0", "--worker", "0", token_file=str(token_file))
        assert both.returncode == 2 and "one of them" in both.stderr, both

        s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        assert s.island == 0
        x = pw.device_put(np.array([1.0, 2.0], np.float32), s.devices)
        np.testing.assert_array_equal(np.asarray(pw.jit(lambda v: v * 2, mesh=s.mesh("d"))(x)), [2.0, 4.0])


def _told_retired(x):
    """Whether reading ``x`` fails because its island was retired: until its session is told,
    the read may still succeed, or fail as any read from a host that went away does."""
    try:
        np.asarray(x)
    except pw.WorkerLostError as e:
        return "retired by the operator" in str(e)
    return False


def test_retiring_a_healthy_island_exits_its_worker_and_tells_the_session_that_had_a_slice_there():
    # restart_workers: the local supervisor starts failed workers again, but not a retired one
    with pw.local_cluster(islands=[pw.Island(1, 1), pw.Island(1, 1)], restart_workers=True) as c:
        here = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=1)
        x = pw.device_put(np.array([3.0, 4.0], np.float32), here.devices)
        add_one = pw.jit(lambda v: v + 1, mesh=here.mesh("d"))
        np.testing.assert_array_equal(np.asarray(add_one(x)), [4.0, 5.0])
        keeper = c.pids[2]
        worker = child_of(keeper)

        report = cluster.retire(c.address, "1", timeout=30)
        assert report["was"] == "healthy" and report["drained"] and report["slices_released"] == 1
        assert report["hosts"] == [here.workers[0]] and len(report["sessions"]) == 1

        # The session hears of it on its own stream, a moment after the operator's reply
        wait_until(lambda: _told_retired(x), timeout=10, what="the session to be told of the retirement")
        with pytest.raises(pw.WorkerLostError, match="retired by the operator"):
            np.asarray(x)
        elsewhere = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        y = pw.device_put(np.array([1.0, 1.0], np.float32), elsewhere.devices)
        with pytest.raises(pw.WorkerLostError, match="retired by the operator"):
            np.asarray(add_one(y))  # its function lived on the retired island
        with pytest.raises(pw.PlacementError):
            pw.make_virtual_device_set().add_slice(cpu_devices=1, island=1)

        wait_until(lambda: pids_alive([worker, keeper]) == [], timeout=30,
                   what="the retired worker and its keeper to exit")
        time.sleep(RESTART_FIRST_PAUSE + 1.0)  # when a restart of a failed worker would have come
        assert c.restarts == 0 and [i["name"] for i in cluster.status(c.address)["islands"]] == ["0"]
        np.testing.assert_array_equal(np.asarray(pw.jit(lambda v: v * 2, mesh=elsewhere.mesh("d"))(y)), [2.0, 2.0])
