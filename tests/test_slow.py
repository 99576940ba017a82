"""Slow is not lost, with real processes: a worker stopped outright (SIGSTOP: the extreme of a
process starved of CPU, or busy in a long compile) for several heartbeat timeouts, its
connection open, is kept and shown slow in the status, and once continued serves the same
client again, with the same pid and the same arrays; a worker that is killed is still lost
at once (its connection closes); a worker cut off the network (no FIN ever comes) is lost
within about 1.4 heartbeat timeouts, its host judged gone because it acknowledges nothing.

The cut runs in network namespaces (tests/netns.py) and is skipped, saying why, where they
cannot be made. Every stopped process is continued in a ``finally``."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from tests.conftest import wait_until
from tests.netns import Network, netns_available  # noqa: F401 (a fixture)

# Short, so that a stop of a few seconds is several timeouts (and on a busy 2-core machine,
# heartbeats at this timeout come late: silence alone would lose workers within seconds).
HEARTBEAT_TIMEOUT = 2.0
# Several heartbeat timeouts, and longer than the client's gRPC keepalive to a worker (about
# 8 s), so that a fetch blocked at the stopped worker outlives a keepalive verdict too.
STOPPED_SECONDS = 5 * HEARTBEAT_TIMEOUT
ROOT = Path(__file__).resolve().parents[1]


def _workers(address: str) -> dict:
    return {w["worker"]: w for w in status(address)["workers"]}


def test_a_stopped_worker_is_slow_not_lost_and_serves_again_while_a_killed_one_is_lost_at_once():
    with pw.local_cluster(hosts=2, devices_per_host=1, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                          restart_workers=False) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
        double = pw.jit(lambda v: v * 2, mesh=s.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
        x = np.arange(4, dtype=np.float32)
        kept = pw.device_put(x, pw.NamedSharding(s.mesh("x"), pw.P("x")))  # half of it on the host to stop
        np.testing.assert_array_equal(double(kept).to_numpy(timeout=120), x * 2)
        before = _workers(c.address)
        stopped = next(w for w in before.values() if w["rank"] == 1)

        os.kill(stopped["pid"], signal.SIGSTOP)
        try:
            pending = double(kept)  # waits for the stopped host
            fetched: list = []  # a fetch blocked at the stopped host for the whole stop
            fetching = threading.Thread(target=lambda: fetched.append(pending.to_numpy(timeout=120)), daemon=True)
            fetching.start()
            time.sleep(STOPPED_SECONDS)
            st = status(c.address)
            slow = {w["worker"]: w["slow"] for w in st["workers"]}
            assert slow[stopped["worker"]] is not None and slow[stopped["worker"]] >= HEARTBEAT_TIMEOUT, slow
            assert st["islands"][0]["healthy"] and st["islands"][0]["lost"] is None, st["islands"]
            cli = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", c.address],
                                 capture_output=True, text=True, timeout=60)
            assert re.search(rf"worker {stopped['worker']} rank 1 host .* pid {stopped['pid']} .*; SLOW \(sent "
                             r"nothing for \d+\.\d s, but its host still acknowledges", cli.stdout), cli.stdout
            assert "island 0: healthy" in cli.stdout, cli.stdout
            assert fetched == [] and fetching.is_alive(), "nothing to fetch while the host is stopped"
        finally:
            os.kill(stopped["pid"], signal.SIGCONT)

        fetching.join(60)
        assert len(fetched) == 1, "the blocked fetch ends once the host runs again"
        np.testing.assert_array_equal(fetched[0], x * 2)
        np.testing.assert_array_equal(pending.to_numpy(timeout=60), x * 2)
        np.testing.assert_array_equal(double(kept).to_numpy(timeout=60), x * 2)  # its array lived through it
        wait_until(lambda: all(w["slow"] is None for w in _workers(c.address).values()), timeout=30,
                   what="the slow mark to go once the worker answers")
        assert {w: v["pid"] for w, v in _workers(c.address).items()} == {w: v["pid"] for w, v in before.items()}

        os.kill(stopped["pid"], signal.SIGKILL)  # its kernel closes the connection: lost, no waiting
        killed = time.monotonic()
        with pytest.raises(pw.WorkerLostError, match=f"pid {stopped['pid']}"):
            double(kept).to_numpy(timeout=60)
        lost = wait_until(lambda: status(c.address)["islands"][0]["lost"], timeout=30, what="the island to be lost")
        seconds = time.monotonic() - killed
        print(f"\nkilled worker: declared lost {seconds:.1f} s after SIGKILL: {lost}")
        assert f"pid {stopped['pid']}" in lost and "its connection closed" in lost, lost
        assert "stopped answering" not in lost, "a closed connection needs no silence to be lost"


@pytest.mark.usefixtures("netns_available")
def test_a_worker_cut_off_the_network_is_lost_within_the_bound_and_attaches_again_once_back(tmp_path):
    with Network(["ctl", "w"]) as net:
        token, worker_token = tmp_path / "token", tmp_path / "worker-token"
        token.write_text("t" * 64)
        worker_token.write_text("w" * 64)
        address = f"grpc://{net.addr('ctl')}:50051"
        env = {"PYTHONPATH": str(ROOT), "PATHWAYS_TOKEN": "", "PATHWAYS_WORKER_TOKEN": ""}
        secrets = ["--token-file", str(token), "--worker-token-file", str(worker_token),
                   "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        net.popen("ctl", [sys.executable, "-m", "pathways", "controller", "--bind", f"{net.addr('ctl')}:50051",
                          *secrets], env=env)
        net.popen("w", [sys.executable, "-m", "pathways", "worker", "--controller", address, "--island", "a",
                        *secrets], env=env)

        def island():
            out = net.run("ctl", [sys.executable, "-m", "pathways", "status", "--address", address, "--token-file",
                                  str(token), "--timeout", "10"], timeout=60, text=True, env=env)
            return re.search(r"island a \(id \d+\): (\S+)(.*)", out.stdout)

        wait_until(lambda: (found := island()) and found[1] == "healthy,", timeout=180,
                   what="the worker to attach")
        net.link_down("w")
        cut = time.monotonic()
        try:
            found = wait_until(lambda: (found := island()) and found[1] == "UNHEALTHY" and found, timeout=30,
                               what="the cut worker to be lost")
            seconds = time.monotonic() - cut
            print(f"\ncut worker: declared lost {seconds:.1f} s after its link went down: {found[2]}")
            assert "stopped answering for" in found[2] and "its host acknowledged nothing for" in found[2], found[2]
            # silence counts from the last word heard (up to an interval before the cut); the host is
            # judged gone once nothing was acknowledged for the timeout: about 1.4 timeouts in all
            assert seconds < 3 * HEARTBEAT_TIMEOUT + 2.0, seconds
        finally:
            net.link_up("w")
        # the worker judged the silent controller gone the same way, and attaches again
        wait_until(lambda: (found := island()) and found[1] == "healthy,", timeout=180,
                   what="the worker to attach again once its link is back")
