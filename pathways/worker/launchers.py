"""Where a worker stands in its island, read from the launcher that started it.

Under Slurm (``srun``) and Kubernetes indexed Jobs (JobSet's child Jobs among them), every
host runs the same command line and reads its rank, and where the launcher knows it its
island's size, from its environment, the way ``jax.distributed.initialize()`` detects its
cluster (jax/_src/clusters/slurm_cluster.py and k8s_cluster.py):

- Slurm, inside a job step (what jax requires: SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID,
  SLURM_STEP_NODELIST): rank SLURM_PROCID, hosts SLURM_STEP_NUM_TASKS (else SLURM_NTASKS).
  A batch script's own shell is no step, so a process started there is not a Slurm task.
- Kubernetes indexed Job (``completionMode: Indexed``): rank JOB_COMPLETION_INDEX. The
  island's size is the Job's parallelism, which only the Kubernetes API tells (jax asks it),
  so ``--island-hosts`` must say it.
- JobSet (JOBSET_NAME, REPLICATED_JOB_NAME and JOB_INDEX set): as an indexed Job, and each
  child Job is one island, named like the Job: JOBSET_NAME-REPLICATED_JOB_NAME-JOB_INDEX.

Explicit flags always win; the combination must still make sense (a rank within the
island), and an error names where each number came from and what to change. Pure: no
process state is read but the mapping passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

from pathways.errors import PathwaysError

LAUNCHERS = ("auto", "none", "slurm", "kubernetes")

# What jax's SlurmCluster.is_env_present requires: the variables of a task of a job step.
_SLURM_STEP = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
_K8S_INDEX = "JOB_COMPLETION_INDEX"
_JOBSET = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX")


class LaunchError(PathwaysError):
    """The launcher's environment and the worker's flags do not make a place in an island."""


@dataclass(frozen=True)
class Launch:
    """A worker's place: ``rank`` in its island (None: the controller assigns one in order of
    arrival), ``hosts`` in the island (None: nobody said), the island's name (None: the
    worker's default), and ``source``: "slurm", "kubernetes", "jobset" or "flags". The
    ``*_from`` fields say where each value came from, for messages."""

    rank: Optional[int]
    hosts: Optional[int]
    island: Optional[str]
    source: str
    rank_from: str = ""
    hosts_from: str = ""
    island_from: str = ""


def detect(environ: Mapping[str, str], launcher: str = "auto") -> Optional[Launch]:
    """What the launcher's environment says, or None when no launcher started this process
    (or ``launcher`` is "none"). ``launcher`` "slurm" or "kubernetes" insists on that one and
    raises LaunchError when its variables are missing; "auto" takes whichever is present and
    refuses an environment that looks like both."""
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "none":
        return None
    slurm = all(v in environ for v in _SLURM_STEP)
    k8s = _K8S_INDEX in environ
    if launcher == "auto":
        if slurm and k8s:
            raise LaunchError("the environment has both a Slurm job step (SLURM_PROCID) and a Kubernetes indexed "
                              f"Job ({_K8S_INDEX}); say which started this worker: --launcher slurm, "
                              "--launcher kubernetes, or --launcher none to use the flags alone")
        launcher = "slurm" if slurm else "kubernetes" if k8s else "none"
        if launcher == "none":
            return None
    if launcher == "slurm":
        if not slurm:
            missing = [v for v in _SLURM_STEP if v not in environ]
            raise LaunchError(f"--launcher slurm, but {', '.join(missing)} is not set: start the worker with srun "
                              "(a batch script's own shell is not a job step), or drop --launcher slurm")
        return _slurm(environ)
    if not k8s:
        raise LaunchError(f"--launcher kubernetes, but {_K8S_INDEX} is not set: run the workers as a Job with "
                          "completionMode: Indexed (or a JobSet), or drop --launcher kubernetes")
    return _kubernetes(environ)


def resolve(environ: Mapping[str, str], launcher: str = "auto", rank: Optional[int] = None,
            hosts: Optional[int] = None, island: Optional[str] = None) -> Launch:
    """The worker's place from its flags (``rank``, ``hosts``, ``island``; None when not given)
    and what ``detect`` reads from ``environ``: a flag wins over the environment. ``hosts``
    defaults to 1 when neither says. Raises LaunchError, saying what to change, when the
    result cannot be a place in an island: a rank outside 0..hosts-1, fewer than one host,
    or a Kubernetes pod whose island size nobody gives."""
    found = detect(environ, launcher)
    launch = found or Launch(None, None, None, "flags")
    if rank is not None:
        launch = replace(launch, rank=rank, rank_from=f"--rank {rank}")
    if hosts is not None:
        launch = replace(launch, hosts=hosts, hosts_from=f"--island-hosts {hosts}")
    if island is not None:
        launch = replace(launch, island=island, island_from=f"--island {island}")
    if launch.hosts is None:
        if launch.source in ("kubernetes", "jobset"):
            raise LaunchError(f"a Kubernetes indexed Job tells each pod its index ({launch.rank_from}) but not how "
                              "many pods the island has: pass --island-hosts N with N the Job's parallelism "
                              "(the same on every pod)")
        launch = replace(launch, hosts=1, hosts_from="the default of 1 host")
    if launch.hosts < 1:
        raise LaunchError(f"an island needs at least 1 host, got {launch.hosts_from}")
    if launch.rank is not None and not 0 <= launch.rank < launch.hosts:
        raise LaunchError(_out_of_range(launch))
    return launch


def _out_of_range(launch: Launch) -> str:
    msg = (f"rank {launch.rank} ({launch.rank_from}) is outside the island of {launch.hosts} host(s) "
           f"({launch.hosts_from}); ranks run from 0 to {launch.hosts - 1}. ")
    if launch.source == "slurm" and launch.rank_from.startswith("--rank"):
        return msg + "Under srun each task's rank is its SLURM_PROCID: drop --rank"
    if launch.source == "slurm":
        return msg + (f"Start as many tasks as the island has hosts (srun -n {launch.hosts}), or drop "
                      "--island-hosts so that the step's task count sets it")
    if launch.source in ("kubernetes", "jobset") and not launch.rank_from.startswith("--rank"):
        return msg + "Make --island-hosts the Job's parallelism"
    return msg + "Pass a --rank below --island-hosts, or leave --rank out for the controller to assign one"


def _int(environ: Mapping[str, str], name: str, least: int) -> int:
    value = environ[name]
    try:
        n = int(value)
    except ValueError:
        n = least - 1
    if n < least:
        raise LaunchError(f"{name}={value!r} is not an integer >= {least}; the launcher's environment looks "
                          "damaged: start the worker from the launcher afresh, or pass --launcher none and "
                          "give --rank and --island-hosts by hand")
    return n


def _slurm(environ: Mapping[str, str]) -> Launch:
    rank = _int(environ, "SLURM_PROCID", 0)
    # The step's own task count: a batch job's SLURM_NTASKS may cover several steps.
    for count in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if count in environ:
            hosts = _int(environ, count, 1)
            return Launch(rank, hosts, None, "slurm", f"SLURM_PROCID={rank}", f"{count}={hosts}")
    return Launch(rank, None, None, "slurm", f"SLURM_PROCID={rank}")


def _kubernetes(environ: Mapping[str, str]) -> Launch:
    rank = _int(environ, _K8S_INDEX, 0)
    if not all(environ.get(v) for v in _JOBSET):
        return Launch(rank, None, None, "kubernetes", f"{_K8S_INDEX}={rank}")
    job = _int(environ, "JOB_INDEX", 0)
    island = f"{environ['JOBSET_NAME']}-{environ['REPLICATED_JOB_NAME']}-{job}"
    return Launch(rank, None, island, "jobset", f"{_K8S_INDEX}={rank}", "", f"the JobSet's Job {island}")
