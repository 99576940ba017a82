import compileall
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status, worker_stats
from pathways.template import template_pids
from pathways.config import COMPILE_CACHE

# The package imports each public name's module when first used (pathways/__init__.py):
# import them all now, so that what a test times is never an import.
for _name in pw.__all__:
    getattr(pw, _name)


def pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
            pass
    return alive


def live_processes():
    """(pid, fields of /proc/PID/stat after the command name) of every process that runs
    now (zombies excluded: they no longer run); fields[1] is the parent, fields[3] the session."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            yield int(entry), fields


def processes_marked(entry):
    """The live processes whose environment holds ``entry`` (b"NAME=value"): a mark given to
    the processes a test starts is inherited by all they start in turn."""
    found = []
    for pid, _ in live_processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def child_pids():
    """This process's live children, except its process templates (pathways/template.py),
    which serve every local cluster it starts and live as long as it does."""
    templates = set(template_pids())
    return {pid for pid, fields in live_processes() if int(fields[1]) == os.getpid() and pid not in templates}


def child_of(pid, timeout=30.0):
    """The one child of process ``pid``: the worker that a worker's keeper runs (the
    process ``pathways worker`` starts keeps the worker as its child, keeper.py)."""
    def child():
        found = [p for p, fields in live_processes() if int(fields[1]) == pid]
        return found[0] if len(found) == 1 else None
    return wait_until(child, timeout, f"process {pid}'s child")


def worker_pids(address):
    """The pids of the worker processes attached to the controller at ``address``."""
    return [w["pid"] for w in status(address)["workers"]]


def tcp_sockets(pid):
    """The TCP sockets process ``pid`` holds, from /proc/PID/net/tcp and tcp6, each as
    (local address, remote address, state) as those tables write them: addresses in 32-bit
    words of host byte order, in hex, then the port; state 0A is LISTEN, 01 ESTABLISHED."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    rows = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows += [line.split() for line in f.readlines()[1:]]
    return [(r[1], r[2], r[3]) for r in rows if r[9] in inodes]


def connected_to(pid, port):
    """Whether process ``pid`` holds an established TCP connection to ``port`` (on any host)."""
    return any(remote.endswith(f":{port:04X}") and state == "01" for _, remote, state in tcp_sockets(pid))


def wait_until(predicate, timeout=20.0, what="condition"):
    """``predicate()``'s first true value, asked again and again, less often the longer the
    wait (most predicates are calls to a server: CPU the suite's other processes need)."""
    deadline = time.monotonic() + timeout
    pause = 0.02
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)


def read_line(proc, timeout=60.0):
    """The next line of a child's stdout, or AssertionError after ``timeout`` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"the child process printed nothing within {timeout} s")
    return proc.stdout.readline()


def session_handles(address, session_id):
    """How many buffers of ``session_id`` the workers of the cluster at ``address`` hold."""
    return sum(worker_stats(w["address"])["sessions"].get(session_id, 0) for w in status(address)["workers"])


def check_a_transfer_between_the_hosts(into=None):
    """On the default session's cluster of two hosts with four devices each: an array moves
    from one host to the other (to the worker whose id is ``into``, if given) and comes back
    computed on."""
    a = pw.make_virtual_device_set().add_slice(cpu_devices=4)
    b = pw.make_virtual_device_set().add_slice(cpu_devices=4)
    assert a.workers != b.workers, "the two slices should take one host each"
    if into in a.workers:
        a, b = b, a
    move = pw.program(lambda x: pw.jit(lambda v: v + 1, mesh=b.mesh("d"))(x))
    np.testing.assert_array_equal(np.asarray(move(pw.device_put(np.arange(3.0, dtype=np.float32), a.devices))),
                                  [1.0, 2.0, 3.0])


def run_device_checks(script, groups, timeout):
    """Run ``python script GROUP`` for each group side by side, in processes with four CPU
    devices, and return {group: the JSON object each printed on its last line}."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           # Four devices; little LLVM optimisation, since compiling dominates the checks'
           # time and what they measure (values, buffer sizes, the HLO) does not depend on it.
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(script).parent), str(Path(script).parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    procs = {group: subprocess.Popen([sys.executable, str(script), group], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
             for group in groups}
    results = {}
    try:
        for group, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise AssertionError(f"the {group} checks did not finish within {timeout} s:\n{err[-4000:]}")
            assert proc.returncode == 0, f"the {group} checks failed:\n{err[-4000:]}"
            results[group] = json.loads(out.splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def running_cluster(*islands):
    """For a module-scoped fixture: a local cluster of ``islands``; afterwards, check that
    none of its processes is left."""
    with pw.local_cluster(islands=list(islands)) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


def connected(cluster):
    """For a fixture: this test's client session on ``cluster``."""
    pw.connect(cluster.address)
    yield pw.default_session()
    pw.disconnect()


@pytest.fixture(scope="session")
def cluster():
    """One island of two worker processes with four CPU devices each, shared by the tests."""
    with pw.local_cluster(hosts=2, devices_per_host=4) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


@pytest.fixture
def session(cluster):
    pw.connect(cluster.address)
    yield pw.default_session()
    pw.disconnect()


@pytest.fixture(autouse=True)
def _no_env_address(monkeypatch):
    monkeypatch.delenv("PATHWAYS_ADDRESS", raising=False)
    yield


def pytest_configure(config):
    os.environ.setdefault("PATHWAYS_LOG_LEVEL", "error")
    # A shell runs a background job with SIGINT ignored, children inherit that, and a Python
    # started so keeps ignoring it: the tests that interrupt a child as a terminal's Ctrl-C
    # would need the children to take it. A handled signal is at its default in a child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # once, in the process that starts pytest-xdist's workers
        _compile_sources()
        _share_executables(config)


def _share_executables(config):
    """The workers of every cluster the tests start keep their executables in one directory
    for the run (pathways/worker/compile_cache.py), as a machine's workers do in production:
    a function the tests run on many clusters compiles once, not once per cluster."""
    if COMPILE_CACHE.name in os.environ:
        return
    directory = tempfile.mkdtemp(prefix="pathways-compile-cache-")
    os.environ[COMPILE_CACHE.name] = directory  # pytest-xdist's workers, started next, inherit it

    def remove():
        os.environ.pop(COMPILE_CACHE.name, None)
        shutil.rmtree(directory, ignore_errors=True)

    config.add_cleanup(remove)


def _compile_sources():
    """Byte-compile the repository's modules before the tests start hundreds of processes
    that import them: with PYTHONDONTWRITEBYTECODE set (as on some CI machines) Python never
    writes a module's bytecode, and every process would compile every module it imports."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("pathways", "pathways_bench", "tests"):
        compileall.compile_dir(os.path.join(root, package), quiet=2)
