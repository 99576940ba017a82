"""What a user sees on the terminal: the user's stdout carries only the program's output,
the command line exits with meaningful codes, and its help and pipes behave."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

import pathways as pw
from pathways.__main__ import main
from pathways.cluster import status
from tests.conftest import live_processes, pids_alive, read_line, wait_until
from tests.test_bench import check_tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pathways(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pathways", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def children_of(pid):
    """{pid: command line} of the live children of process ``pid``."""
    found = {}
    for child, fields in live_processes():
        if int(fields[1]) != pid:
            continue
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[child] = " ".join(c.decode() for c in f.read().split(b"\0") if c)
        except OSError:
            continue  # gone meanwhile
    return found


def cluster_processes(pid):
    """{pid: command line} of the processes of the local cluster that process ``pid`` runs:
    the children of its process template (pathways/template.py), which forks them."""
    (template,) = [child for child, cmd in children_of(pid).items() if "-m pathways.template" in cmd]
    return children_of(template)


def session_members(sid):
    """The live processes of session ``sid``."""
    return [pid for pid, fields in live_processes() if int(fields[3]) == sid]


MULTI_HOST_SCRIPT = """
import os, signal, threading
import jax, numpy as np, pathways as pw
from pathways.cluster import status
with pw.local_cluster(hosts=2, devices_per_host=1) as cluster:
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
    print(np.asarray(total(np.array([3.0, 4.0], np.float32))))
    # rank 1 is slow to stop: it has not left the island's jax.distributed group when rank 0,
    # which runs the group's coordination service, is told to stop
    (second,) = [w["pid"] for w in status(cluster.address)["workers"] if w["rank"] == 1]
    os.kill(second, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (second, signal.SIGCONT)).start()
"""


def test_a_script_on_a_multi_host_cluster_gets_a_clean_stdout_and_no_start_up_or_stop_notices(tmp_path, monkeypatch):
    # None either when a host is slow to stop: rank 0 leaving first would make it abort with
    # jax.distributed's fatal error (worker/island.py leave_group).
    monkeypatch.delenv("PATHWAYS_LOG_LEVEL", raising=False)  # the default level, as a user has it
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(MULTI_HOST_SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[7. 7.]\n", "gloo's notices of the workers must not reach the user's stdout"
    assert "coordination_service" not in out.stderr and "Terminating process" not in out.stderr, out.stderr
    # nor any other line of the C++ libraries' logs (gRPC's GOAWAY notice from the stopped
    # host's connections, say): nothing went wrong
    assert not re.search(r"^[IWEF]\d{4} ", out.stderr, re.M), out.stderr
    assert "[Gloo]" not in out.stderr, "gloo's connection notices are logged at info, not shown"


SPMD_SCRIPT = """
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
print("total", float(multihost_utils.process_allgather(jnp.array([1.0])).sum()))
"""


def test_spmd_processes_print_only_the_script_output_on_stdout(tmp_path, monkeypatch):
    monkeypatch.delenv("PATHWAYS_LOG_LEVEL", raising=False)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SPMD_SCRIPT))
    out = pathways("spmd", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[0] total 2.0", "[1] total 2.0"]
    assert "coordination_service" not in out.stderr, out.stderr


def test_up_restarts_its_controller_when_it_dies_and_the_workers_attach_again():
    up = subprocess.Popen([sys.executable, "-m", "pathways", "--log-level", "warning", "up", "--islands", "1x1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    children = {}
    try:
        line = read_line(up, timeout=90)
        assert "pathways cluster up at grpc://" in line
        address = line.split()[4].rstrip(";")
        children = cluster_processes(up.pid)
        controller = next(pid for pid, cmd in children.items() if "-m pathways controller" in cmd)
        worker = next(pid for pid, cmd in children.items() if "keeper.py" in cmd)
        os.kill(controller, signal.SIGKILL)
        wait_until(lambda: any("-m pathways controller" in cmd for pid, cmd in cluster_processes(up.pid).items()
                               if pid != controller),
                   timeout=30, what="a new controller")
        st = wait_until(lambda: _status_or_none(address), timeout=60, what="the workers to attach to it again")
        assert pids_alive([worker]) == [worker], "the worker's keeper kept running"
        assert [w["pid"] for w in st["workers"]] == list(children_of(worker)), "and restarted the worker"
        assert up.poll() is None, "up keeps running"
        children = {**children_of(up.pid), **cluster_processes(up.pid)}
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        stderr = up.stderr.read()
        assert "restarting the controller" in stderr and f"the controller restarted at {address}" in stderr, stderr
        wait_until(lambda: not pids_alive(children), timeout=10, what="the cluster's processes to be stopped")
    finally:
        for pid in [up.pid, *children]:
            if pids_alive([pid]):
                os.kill(pid, signal.SIGKILL)
        up.wait(timeout=10)
        up.stdout.close()
        up.stderr.close()


def _status_or_none(address):
    """The controller's status once it has a worker attached, else None."""
    try:
        st = status(address, timeout=2)
    except (pw.PathwaysError, grpc.RpcError):
        return None
    return st if st["workers"] else None


def test_plan_help_shows_the_planners_options(capsys, monkeypatch):
    # in this process: the command line's parsers, without an interpreter's start each; main
    # sets the log level of child processes in the environment, which monkeypatch restores
    monkeypatch.setenv("PATHWAYS_LOG_LEVEL", os.environ.get("PATHWAYS_LOG_LEVEL", "error"))
    for flag in ("--help", "-h"):
        assert main(["plan", flag]) == 0
        out = capsys.readouterr().out
        assert "pipeline" in out and "dag" in out, out
    assert main(["plan", "pipeline", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--objective" in out and "--time-limit" in out
    assert main(["status", "--bogus"]) == 2, "other commands still reject unknown arguments"
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_status_into_a_closed_pipe_exits_quietly(cluster):
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "status", "--address", cluster.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # like `| head` that has read what it wanted: every write fails
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()


@pytest.mark.soak  # a benchmark run, with clusters of its own
def test_bench_explains_its_mode_names_and_prints_one_rounds_value_alone(monkeypatch, tmp_path):
    """Also the dispatch benchmark's run at its tiny size (the others: tests/test_bench.py)."""
    monkeypatch.delenv("PATHWAYS_LOG_LEVEL", raising=False)
    started = time.monotonic()
    out_json, out_png = tmp_path / "dispatch.json", tmp_path / "dispatch.png"
    # in a session of its own, so that any process it leaves behind can be found
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "bench", "dispatch", "--tiny", "--rounds", "1",
                             "--json", str(out_json), "--plot", str(out_png)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert session_members(proc.pid) == [], "bench dispatch left processes running"
    check_tiny_run("dispatch", out_json, out_png, stdout)
    for name in ("JAX-O", "JAX-F", "PW-O", "PW-C", "PW-F"):
        assert f"\n{name}: " in stdout, stdout
    rows = stdout.split("median (min-max) of the rounds\n")[1].split("\n\n")[0].splitlines()[2:]
    assert rows and not any("(" in row for row in rows), f"one round has no (min-max) spread:\n{rows}"
    assert "[Gloo]" not in stdout and "coordination_service" not in stderr
    assert time.monotonic() - started < 300
