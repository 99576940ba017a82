"""A worker's place in its island from its launcher's environment (pure: env dicts)."""

import os
import subprocess
import sys

import pytest

from pathways.worker.launchers import Launch, LaunchError, detect, resolve

# What srun gives task 1 of `srun -n 2` (measured with Slurm 22.05, trimmed).
SLURM = {"SLURM_JOB_ID": "7", "SLURM_JOBID": "7", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
         "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_NODEID": "1"}
# A batch script's own shell: a job, but no step.
SLURM_BATCH = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3", "HOSTNAME": "workers-3-abcde"}
JOBSET = {**K8S, "JOBSET_NAME": "pw", "REPLICATED_JOB_NAME": "islands", "JOB_INDEX": "1",
          "REPLICATED_JOB_REPLICAS": "2"}


def test_srun_tasks_read_their_rank_and_the_steps_task_count():
    assert detect(SLURM) == Launch(1, 2, None, "slurm", "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=2")
    # The step's task count, not the job's: a job of 4 tasks running a step of 2.
    assert resolve({**SLURM, "SLURM_NTASKS": "4"}).hosts == 2
    # Without SLURM_STEP_NUM_TASKS (older Slurm), SLURM_NTASKS as jax reads it.
    step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert (resolve(step).rank, resolve(step).hosts) == (1, 2)


def test_a_batch_scripts_own_shell_is_no_slurm_task():
    assert detect(SLURM_BATCH) is None
    assert resolve(SLURM_BATCH) == Launch(None, 1, None, "flags", hosts_from="the default of 1 host")
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST is not set: start the worker with srun"):
        detect(SLURM_BATCH, "slurm")


def test_no_launcher_means_flags_alone():
    assert resolve({}) == Launch(None, 1, None, "flags", hosts_from="the default of 1 host")
    got = resolve({}, rank=1, hosts=2, island="a")
    assert (got.rank, got.hosts, got.island, got.source) == (1, 2, "a", "flags")
    # --launcher none ignores a launcher's environment.
    assert resolve(SLURM, "none").rank is None and resolve(K8S, "none").hosts == 1


def test_flags_win_over_the_environment():
    got = resolve(SLURM, hosts=3, island="a")
    assert (got.rank, got.hosts, got.island) == (1, 3, "a")
    assert got.hosts_from == "--island-hosts 3"
    assert resolve(SLURM, rank=0).rank == 0
    assert resolve(JOBSET, hosts=4, island="mine").island == "mine"


def test_a_rank_outside_the_slurm_task_count_is_refused():
    with pytest.raises(LaunchError) as e:
        resolve(SLURM, rank=2)
    msg = str(e.value)
    assert "rank 2 (--rank 2) is outside the island of 2 host(s) (SLURM_STEP_NUM_TASKS=2)" in msg
    assert "drop --rank" in msg
    with pytest.raises(LaunchError, match=r"rank 1 \(SLURM_PROCID=1\) is outside the island of 1 host\(s\) "
                                          r"\(--island-hosts 1\).*srun -n 1"):
        resolve(SLURM, hosts=1)


def test_kubernetes_indexed_job_gives_the_rank_and_the_flag_the_size():
    got = resolve(K8S, hosts=4)
    assert (got.rank, got.hosts, got.island, got.source) == (3, 4, None, "kubernetes")
    with pytest.raises(LaunchError, match="pass --island-hosts N with N the Job's parallelism"):
        resolve(K8S)
    with pytest.raises(LaunchError, match=r"rank 3 \(JOB_COMPLETION_INDEX=3\).*Job's parallelism"):
        resolve(K8S, hosts=2)


def test_a_jobset_names_one_island_per_child_job():
    got = resolve(JOBSET, hosts=4)
    assert (got.rank, got.hosts, got.island, got.source) == (3, 4, "pw-islands-1", "jobset")
    # Without the JobSet's variables it is a plain indexed Job.
    assert resolve({**K8S, "JOBSET_NAME": "pw"}, hosts=4).island is None


def test_forced_launchers_say_what_is_missing():
    with pytest.raises(LaunchError, match="JOB_COMPLETION_INDEX is not set.*completionMode: Indexed"):
        detect(SLURM, "kubernetes")
    assert detect({**SLURM, **K8S}, "slurm").source == "slurm"
    assert detect({**SLURM, **K8S}, "kubernetes").source == "kubernetes"
    with pytest.raises(LaunchError, match="both a Slurm job step.*--launcher slurm"):
        detect({**SLURM, **K8S})
    with pytest.raises(LaunchError, match="--launcher must be one of"):
        detect({}, "mpi")


@pytest.mark.parametrize("env, var", [({**SLURM, "SLURM_PROCID": "one"}, "SLURM_PROCID"),
                                      ({**SLURM, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS"),
                                      ({**K8S, "JOB_COMPLETION_INDEX": "-1"}, "JOB_COMPLETION_INDEX"),
                                      ({**JOBSET, "JOB_INDEX": "x"}, "JOB_INDEX")])
def test_damaged_launcher_variables_are_named(env, var):
    with pytest.raises(LaunchError, match=f"^{var}=.*--launcher none"):
        resolve(env, hosts=8)


def test_island_size_must_be_positive():
    with pytest.raises(LaunchError, match="at least 1 host, got --island-hosts 0"):
        resolve({}, hosts=0)
    with pytest.raises(LaunchError, match=r"rank -1 \(--rank -1\).*leave --rank out"):
        resolve({}, rank=-1, hosts=2)


def test_the_worker_command_refuses_a_place_it_cannot_take():
    env = {**os.environ, "JOB_COMPLETION_INDEX": "1"}
    done = subprocess.run([sys.executable, "-m", "pathways", "worker", "--controller", "grpc://127.0.0.1:1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: a Kubernetes indexed Job tells each pod its index (JOB_COMPLETION_INDEX=1)" in done.stderr
