"""Workers started by a real Slurm: a one-machine Slurm (slurmctld and slurmd on loopback,
auth/none) that the test starts and stops itself, and `srun -n 2 python -m pathways worker`
with one command line for both hosts of an island. Skipped where Slurm is not installed
(Debian: apt-get install slurm-wlm) or the test does not run as root."""

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import free_port, stop_processes, wait_for_workers
from pathways.defaults import ADDRESS_LINE
from tests.conftest import processes_marked, read_line

_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_TOOLS = ("slurmctld", "slurmd", "srun", "sinfo", "scancel", "squeue")
_PLUGIN_DIRS = ("/usr/lib/*/slurm-wlm", "/usr/lib/*/slurm", "/usr/lib64/slurm", "/usr/lib/slurm", "/usr/local/lib/slurm")
_START_TIMEOUT = 60.0
_REPO = Path(__file__).resolve().parent.parent


def _unavailable():
    missing = [t for t in _TOOLS if not shutil.which(t, path=_SBIN)]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not found; Debian: apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "a one-machine Slurm needs root here (slurmd starts tasks as their user)"
    if not any(glob.glob(os.path.join(d, "auth_none.so")) for d in _PLUGIN_DIRS):
        return "this Slurm has no auth/none plugin, and the test runs no munge daemon"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

_CONF = """\
ClusterName=pathways
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=pathways Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


class Slurm:
    """A running one-machine Slurm; ``env`` points its commands at it (SLURM_CONF)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf, "PATH": _SBIN}
        self.daemons: list[subprocess.Popen] = []

    def run(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, cwd=_REPO, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            with contextlib.suppress(OSError), open(os.path.join(self.dir, name)) as f:
                out.append(f"--- {name} (last lines)\n" + "".join(f.readlines()[-20:]))
        return "\n".join(out)

    def ours(self) -> list[int]:
        """Every process this Slurm started or runs: daemons, step daemons, tasks and sruns
        all carry SLURM_CONF naming this cluster's own file."""
        return [pid for pid in processes_marked(f"SLURM_CONF={self.conf}".encode()) if pid != os.getpid()]


@pytest.fixture
def slurm():
    with tempfile.TemporaryDirectory(prefix="pathways-slurm-") as directory:
        os.makedirs(os.path.join(directory, "state"))
        os.makedirs(os.path.join(directory, "spool"))
        cluster = Slurm(directory)
        host = socket.gethostname().split(".")[0]
        with open(cluster.conf, "w") as f:
            f.write(_CONF.format(host=host, ctld_port=free_port(), d_port=free_port(), dir=directory,
                                 cpus=os.cpu_count() or 1))
        try:
            for cmd in (["slurmctld", "-D", "-f", cluster.conf], ["slurmd", "-D", "-f", cluster.conf, "-N", host]):
                cluster.daemons.append(subprocess.Popen(cmd, env=cluster.env, stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + _START_TIMEOUT
            while cluster.run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
                if time.monotonic() > deadline or any(d.poll() is not None for d in cluster.daemons):
                    pytest.fail(f"the test's Slurm did not come up within {_START_TIMEOUT:.0f} s:\n{cluster.logs()}")
                time.sleep(0.2)
            yield cluster
        finally:
            cluster.run("scancel", "--full", "--user", "root")
            deadline = time.monotonic() + 15
            while cluster.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
            stop_processes(cluster.daemons)
            for pid in cluster.ours():  # step daemons and tasks of a step that outlived its daemons
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert not cluster.ours(), "processes of the test's Slurm survived it"


@pytest.fixture
def controller():
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "controller"], stdout=subprocess.PIPE, text=True)
    try:
        line = read_line(proc)
        assert line.startswith(ADDRESS_LINE), line
        yield line.split()[1]
    finally:
        stop_processes([proc])


def _new_island_contract() -> bool:
    """Whether workers learn their island's jax.distributed coordinator from the controller
    (`--island NAME`), or the island's hosts are told it (`--coordinator HOST:PORT`)."""
    out = subprocess.run([sys.executable, "-m", "pathways", "worker", "--help"], capture_output=True, text=True,
                         timeout=120)
    return "--coordinator" not in out.stdout


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)


def test_srun_starts_an_island_whose_hosts_take_their_ranks_from_slurm(slurm, controller, tmp_path):
    # One command line for both tasks: no --rank; the island's size is the step's task count.
    worker = [sys.executable, "-m", "pathways", "worker", "--controller", controller]
    new = _new_island_contract()
    worker += ["--island", "a"] if new else ["--coordinator", f"127.0.0.1:{free_port()}"]
    log = open(tmp_path / "srun.log", "w+")
    srun = subprocess.Popen(["srun", "-n", "2", "-O", "--kill-on-bad-exit=1", *worker], env=slurm.env, cwd=_REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            st = wait_for_workers(controller, 2, 120)
        except pw.PathwaysError as e:
            log.seek(0)
            pytest.fail(f"{e}\nsrun's output:\n{log.read()}\n{slurm.logs()}")
        workers = st["workers"]
        assert sorted(w["rank"] for w in workers) == [0, 1]
        assert len({w["island"] for w in workers}) == 1
        for w in workers:  # each host's rank is the SLURM_PROCID srun gave its task
            env = _environ(w["pid"])
            assert env["SLURM_CONF"] == slurm.conf and int(env["SLURM_PROCID"]) == w["rank"], w
        island, = st["islands"]
        assert island["healthy"] and island["hosts"] == 2
        if new:
            assert island["name"] == "a"
        # A slice over both hosts runs one SPMD computation: the island's jax.distributed group formed.
        pw.connect(controller)
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
        assert len(s.workers) == 2
        total = pw.pmap(lambda x: x + jax.lax.psum(x, "i"), devices=s.devices)
        assert np.asarray(total(np.array([1.0, 2.0], np.float32))).tolist() == [4.0, 5.0]
    finally:
        pw.disconnect()
        stop_processes([srun], grace=10)
        log.close()


def test_a_rank_outside_the_steps_tasks_is_refused_by_every_task(slurm):
    done = slurm.run("srun", "-n", "2", "-O", sys.executable, "-m", "pathways", "worker", "--controller",
                     "grpc://127.0.0.1:1", "--rank", "2", timeout=120)
    assert done.returncode != 0
    msg = "rank 2 (--rank 2) is outside the island of 2 host(s) (SLURM_STEP_NUM_TASKS=2)"
    assert (done.stdout + done.stderr).count(msg) == 2, done.stdout + done.stderr
