"""The command line: status of a running cluster, and the Figure 2 demo on an embedded one."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw
from pathways.controller.scheduler import DEFAULT_WINDOW, SOLO_FACTOR


def run(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "pathways", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_status_shows_islands_hosts_slices_clients_queues_and_work_in_flight(cluster, session):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=4)

    def slow(x):  # about a fifth of a second of work
        return jax.lax.fori_loop(0, 1000, lambda i, y: jnp.tanh(y @ y), x)

    step = pw.jit(slow, mesh=s.mesh("x"))
    x = np.eye(128, dtype=np.float32)
    step(x).block_until_ready(timeout=60)
    solo = DEFAULT_WINDOW * SOLO_FACTOR  # what one client alone may have in flight
    outs = [step(x) for _ in range(solo + 32)]
    out = run("status", "--address", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "2 worker(s)" in out.stdout and f"policy fair, window {DEFAULT_WINDOW} run(s) per island" in out.stdout
    island = re.search(r"island 0: healthy, 2 host\(s\), 8 device\(s\), (\d+) run\(s\) queued, (\d+) in flight",
                       out.stdout)
    assert island, out.stdout
    assert int(island[2]) == solo and int(island[1]) > 0, "as much in flight as one client may have, the rest queued"
    assert out.stdout.count("4 cpu device(s)") == 2
    assert re.search(rf"client session {session.id}: weight 1, 1 slice\(s\), \d+ array\(s\), \d+ run\(s\) "
                     r"queued, \d+ in flight", out.stdout), out.stdout
    outs[-1].block_until_ready(timeout=120)


def test_status_without_an_address_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("PATHWAYS_ADDRESS", raising=False)
    out = run("status")
    assert out.returncode == 2 and "PATHWAYS_ADDRESS" in out.stderr


def test_demo_prints_the_figure2_result_on_an_embedded_cluster():
    # a CA in the environment is for clusters at an address: the embedded one uses no TLS
    out = run("demo", env={**os.environ, "PATHWAYS_TLS_CA": "/nonexistent/ca.pem"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[3. 5.] [2. 4.]"


def test_the_example_script_runs_as_a_user_would():
    example = Path(__file__).resolve().parent.parent / "examples" / "figure2.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3. 5.] [2. 4.]"
