"""The command line: status of a running cluster, and the Figure 2 demo on an embedded one."""

import subprocess
import sys
from pathlib import Path

import pathways as pw


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pathways", *args], capture_output=True, text=True, timeout=timeout)


def test_status_lists_workers_devices_and_sessions(cluster, session):
    pw.make_virtual_device_set().add_slice(cpu_devices=4)
    out = run("status", "--address", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "2 worker(s)" in out.stdout and "session(s)" in out.stdout
    assert out.stdout.count("4 cpu device(s)") == 2


def test_status_without_an_address_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("PATHWAYS_ADDRESS", raising=False)
    out = run("status")
    assert out.returncode == 2 and "PATHWAYS_ADDRESS" in out.stderr


def test_demo_prints_the_figure2_result_on_an_embedded_cluster():
    out = run("demo")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[3. 5.] [2. 4.]"


def test_the_example_script_runs_as_a_user_would():
    example = Path(__file__).resolve().parent.parent / "examples" / "figure2.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3. 5.] [2. 4.]"
