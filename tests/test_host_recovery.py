"""A lost host comes back: `pathways up` restarts a worker that was killed or crashed (by
default), says so in its status meanwhile, and prints the command that replaces a host by hand
(with its worker token in a file only its user can read) for clusters that restart nothing."""

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from tests.conftest import pids_alive, read_line, wait_until

ROOT = Path(__file__).resolve().parent.parent
SERVE_AGAIN_WITHIN = 30.0


class Up:
    """`pathways up --islands ISLANDS FLAGS...`, its printed addresses and the commands that
    replace a host of each island."""

    def __init__(self, *flags: str, islands: str = "1x1") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pathways", "--log-level", "warning", "up",
                                      "--islands", islands, *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.others: list[subprocess.Popen] = []
        self.stderr = ""
        try:
            first = read_line(self.proc, timeout=90)
            assert "pathways cluster up at grpc://" in first, first
            self.address = first.split()[4].rstrip(";")
            self.ifrt_address = None
            if "--ifrt-port" in flags:  # printed with the first line, in one write
                self.ifrt_address = self.proc.stdout.readline().split()[3].rstrip(";")
            self.replacements = []
            for island in range(len(islands.split(","))):
                replace = self.proc.stdout.readline()
                prefix = f"add or replace a host of island {island}: "
                assert replace.startswith(prefix), replace
                self.replacements.append(shlex.split(replace[len(prefix):]))
            self.replacement = self.replacements[0]
        except BaseException:
            self.stop()  # nothing is left running, whatever failed
            raise

    def stop(self) -> None:
        for proc in [*self.others, self.proc]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.stderr = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _worker_pid(address: str) -> int:
    [worker] = status(address)["workers"]
    return worker["pid"]


def _recovery(address: str) -> str:
    try:
        [island] = status(address, timeout=2)["islands"]
    except (pw.PathwaysError, ValueError):
        return ""
    return island.get("recovery") or ""


def _serves(inc, x) -> bool:
    try:
        return bool(np.asarray(inc(x)) == 2.0)
    except pw.PathwaysError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["killed", "crashed"])
def test_a_killed_or_crashed_worker_of_up_is_restarted_and_its_island_serves_the_same_client_again(signum):
    up = Up()  # default flags
    try:
        pw.connect(up.address)
        s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        inc = pw.jit(lambda v: v + 1, mesh=s.mesh(("x",)))
        x = np.float32(1.0)
        assert _serves(inc, x)
        worker = _worker_pid(up.address)
        os.kill(worker, signum)
        lost_at = time.monotonic()
        said = wait_until(lambda: _recovery(up.address), timeout=SERVE_AGAIN_WITHIN, what="the island's recovery")
        assert said.startswith("restarting (attempt 1)"), said
        wait_until(lambda: _serves(inc, x), timeout=SERVE_AGAIN_WITHIN, what="the island to serve again")
        assert time.monotonic() - lost_at < SERVE_AGAIN_WITHIN
        assert _worker_pid(up.address) != worker and not pids_alive([worker])
        assert _recovery(up.address) == ""
    finally:
        pw.disconnect()
        up.stop()
    assert "restarting the worker" in up.stderr, up.stderr
    if signum == signal.SIGSEGV:  # a crash says where each of the worker's threads was
        assert "Fatal Python error: Segmentation fault" in up.stderr and "Thread 0x" in up.stderr, up.stderr


def test_up_without_restarts_says_a_lost_host_stays_lost_and_its_printed_command_replaces_it():
    up = Up("--no-restart-workers")
    try:
        token_file = up.replacement[up.replacement.index("--worker-token-file") + 1]
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(token_file)).st_mode) == 0o700
        pw.connect(up.address)
        s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        inc = pw.jit(lambda v: v + 1, mesh=s.mesh(("x",)))
        x = np.float32(1.0)
        assert _serves(inc, x)
        os.kill(_worker_pid(up.address), signal.SIGKILL)
        said = wait_until(lambda: _recovery(up.address), timeout=SERVE_AGAIN_WITHIN, what="the island's recovery")
        assert said.startswith("lost, not restarted"), said
        with pytest.raises(pw.WorkerLostError, match="lost, not restarted"):
            np.asarray(inc(x))
        time.sleep(1.0)
        assert _recovery(up.address).startswith("lost, not restarted"), "nothing restarts it"
        up.others.append(subprocess.Popen(up.replacement, cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        wait_until(lambda: _serves(inc, x), timeout=60, what="the island to serve again with the new host")
    finally:
        pw.disconnect()
        up.stop()
    assert not os.path.exists(token_file), "up removes its worker token file when it stops"


ELASTIC_SCRIPT = """
import json, sys
import jax
import numpy as np
from pathwaysutils.elastic import manager as elastic_manager

step = jax.jit(lambda w: w * 2.0 + 1.0)
manager = elastic_manager.Manager()
state = {"w": np.zeros(4, np.float32), "steps": 0, "attempts": 0, "events": 0}

def event():
    state["events"] += 1

@manager.elastic_retry(poll_interval=0.5, timeout=180, retry_policy=lambda attempt, error: attempt < 1000,
                       on_elastic_event_callback=event)
def train(steps):
    state["attempts"] += 1
    w = jax.device_put(state["w"], manager.slice_to_devices[1][0])
    while state["steps"] < steps:
        w = step(w)
        state["w"] = np.asarray(w)  # the host's copy of each step: what a retry starts from
        state["steps"] += 1
        if state["steps"] == 2 and state["attempts"] == 1:
            print("READY", flush=True)
            sys.stdin.readline()  # island 1's host is killed
    return state["w"]

trained = train(6)
print("RESULT " + json.dumps({"trained": trained.tolist(), "events": state["events"],
                              "attempts": state["attempts"]}), flush=True)
"""


def test_an_elastic_loop_waits_for_a_host_replaced_by_hand_from_ups_printed_command_with_few_events():
    """pathwaysutils' Manager.elastic_retry around a training step on island 1; its host
    killed mid-loop and, 20 s later, a replacement started from the command `up` printed.
    Meanwhile the manager's health check compiles on the healing island: that succeeds once
    the island is back, so the loop records a handful of elastic events, not one per poll."""
    up = Up("--no-restart-workers", "--ifrt-port", "0", islands="1x1,1x1")
    client = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PATHWAYS_", "IFRT_PROXY_", "JAX_"))}
        env.update(JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=up.ifrt_address, PYTHONPATH=str(ROOT))
        register = "from pathways.ifrt import plugin; plugin.initialize()\n"
        client = subprocess.Popen([sys.executable, "-c", register + ELASTIC_SCRIPT], env=env, cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        up.others.append(client)
        assert read_line(client, timeout=240).strip() == "READY", client.stderr.read()[-3000:]
        host = next(w for w in status(up.address)["workers"] if w["island"] == 1)
        os.kill(host["pid"], signal.SIGKILL)
        client.stdin.write("\n")
        client.stdin.flush()
        time.sleep(20.0)
        up.others.append(subprocess.Popen(up.replacements[1], cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        line = read_line(client, timeout=240)
        assert line.startswith("RESULT "), client.stderr.read()[-3000:]
        result = json.loads(line[len("RESULT "):])
        assert result["trained"] == [63.0] * 4, result  # six steps of w * 2 + 1 from 0, as uninterrupted
        assert 1 <= result["events"] <= 12 and result["attempts"] >= 2, result
    finally:
        up.stop()
