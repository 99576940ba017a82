"""Multi-controller mode (``pw.spmd``): real process groups under jax.distributed."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import pathways as pw
from pathways_bench import gpipe
from tests.conftest import child_pids, connected, processes_marked, running_cluster

CFG = gpipe.Config(stages=2, microbatches=1, batch=16, width=8, hidden=16, lr=0.3)
STEPS = 3


@pytest.fixture(scope="module")
def two_hosts():
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1))


@pytest.fixture
def client(two_hosts):
    yield from connected(two_hosts)


def spmd_train(cfg, params, batches):
    """Runs in every process of the group: the model's step under jax.jit on the group's mesh."""
    import functools

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = pw.spmd.mesh("x")
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    step = jax.jit(functools.partial(gpipe.data_parallel_step, lr=cfg.lr),
                   in_shardings=(replicated, batch, batch), out_shardings=(replicated, replicated))
    params = pw.spmd.device_put(params, replicated)
    losses = []
    for x, t in batches:
        params, loss = step(params, pw.spmd.device_put(x, batch), pw.spmd.device_put(t, batch))
        losses.append(loss)
    return params, losses


def test_the_same_model_gives_identical_numbers_in_both_modes(client):
    batches = gpipe.make_batches(CFG, STEPS)
    before = child_pids()
    spmd_params, spmd_losses = pw.spmd.run(spmd_train, num_processes=2, devices_per_process=1,
                                           args=(CFG, gpipe.init_params(CFG), batches), echo=False)
    assert child_pids() <= before, "pw.spmd.run left processes behind"

    both_hosts = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    assert len(both_hosts.workers) == 2
    step = pw.jit(gpipe.named(gpipe.data_parallel_step, "step", lr=CFG.lr), mesh=both_hosts.mesh("x"),
                  in_shardings=(None, pw.P("x"), pw.P("x")))
    params = gpipe.init_params(CFG)
    losses = []
    for x, t in batches:
        params, loss = step(params, x, t)
        losses.append(loss)

    got = [float(np.asarray(loss)) for loss in losses]
    assert got == [float(v) for v in spmd_losses], "losses differ between pathways and multi-controller JAX"
    assert got[-1] < got[0]
    for stage, (p, q) in enumerate(zip(pw.device_get(params), spmd_params)):
        for name in p:
            assert np.array_equal(np.asarray(p[name]), q[name]), f"stage {stage} parameter {name} differs"


def test_results_come_back_from_every_process_and_sharded_arrays_whole():
    def f(x):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = pw.spmd.mesh("d")
        a = pw.spmd.device_put(x, NamedSharding(mesh, P("d")))
        doubled = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P("d")))(a)
        return {"rank": jax.process_index(), "devices": jax.device_count(), "doubled": doubled,
                "local": len(a.addressable_shards)}

    with pw.spmd.Pool(2, devices_per_process=2, echo=False) as pool:
        results = pool.run_all(f, args=(np.arange(8, dtype=np.float32),))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["devices"] == 4 and r["local"] == 2
        np.testing.assert_array_equal(r["doubled"], np.arange(8, dtype=np.float32) * 2)


def test_a_failure_everywhere_is_reported_and_the_pool_goes_on():
    before = child_pids()
    with pw.spmd.Pool(2, echo=False) as pool:
        with pytest.raises(pw.SpmdError, match=r"raised on process 0: ValueError: bad shape \(3,\)"):
            pool.run(_raise_value_error)
        assert pool.run(lambda: 41 + 1) == 42
    assert child_pids() <= before


def test_a_failure_on_one_process_stops_the_group_instead_of_hanging():
    def one_fails():
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        if jax.process_index() == 1:
            raise RuntimeError("process 1 gives up")
        return multihost_utils.process_allgather(jnp.ones(1))  # waits for process 1 forever

    before = child_pids()
    pool = pw.spmd.Pool(2, echo=False)
    start = time.monotonic()
    with pytest.raises(pw.SpmdError, match=r"(?s)process 1: RuntimeError: process 1 gives up.*\[0\] did not answer"):
        pool.run(one_fails, timeout=60)
    assert time.monotonic() - start < 20
    with pytest.raises(pw.SpmdError, match="closed"):
        pool.run(lambda: 1)
    assert child_pids() <= before, "the stopped group left processes behind"


def test_a_call_past_its_timeout_raises_and_stops_the_group():
    before = child_pids()
    with pw.spmd.Pool(1, echo=False) as pool:
        with pytest.raises(pw.DeadlineExceededError, match="did not finish within 1 s"):
            pool.run(time.sleep, args=(60,), timeout=1)
    assert child_pids() <= before


def test_unpicklable_arguments_get_a_clear_error():
    with pw.spmd.Pool(1, echo=False) as pool:
        with pytest.raises(pw.SpmdError, match="cannot send"):
            pool.run(len, args=(_Unpicklable(),))


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object cannot be pickled")


def _raise_value_error():
    raise ValueError("bad shape (3,)")


SCRIPT = """
import sys
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1.0])).sum()
print(f"process {jax.process_index()} of {jax.process_count()}: total {total:g}, args {sys.argv[1:]}")
if "--fail" in sys.argv and jax.process_index() == 1:
    sys.exit(3)
"""


def test_cli_runs_a_script_in_every_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cmd = [sys.executable, "-m", "pathways", "spmd", "2", str(script), "a", "b"]
    env = marked_env()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "total" in line)
    assert lines == ["[0] process 0 of 2: total 3, args ['a', 'b']", "[1] process 1 of 2: total 3, args ['a', 'b']"]

    failed = subprocess.run(cmd + ["--fail"], capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode == 3
    assert "process 1 exited with code 3" in failed.stderr

    missing = subprocess.run([sys.executable, "-m", "pathways", "spmd", "2", str(tmp_path / "nope.py")],
                             capture_output=True, text=True, timeout=60, env=env)
    assert missing.returncode != 0 and "no such script" in missing.stderr
    assert missing.stderr.startswith("error:"), missing.stderr
    assert not marked_processes(env), "the command left processes behind"


def marked_env():
    """An environment whose processes, and every process they start, carry a mark of their own:
    processes left behind are found by it (other tests may run SPMD processes at the same time)."""
    return {**os.environ, "PATHWAYS_TEST_MARK": f"{os.getpid()}-{time.monotonic_ns()}"}


def marked_processes(env):
    return processes_marked(f"PATHWAYS_TEST_MARK={env['PATHWAYS_TEST_MARK']}".encode())


def test_the_example_trains_identically_in_both_modes():
    done = subprocess.run([sys.executable, "examples/spmd.py"], capture_output=True, text=True, timeout=180,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert "identical: True" in done.stdout


EARLY_FAILURE = """
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

if jax.process_index() == 1:
    raise RuntimeError("rank 1 fails before the collective")
multihost_utils.process_allgather(jnp.array([1.0]))  # rank 0 waits here for rank 1
"""


def test_cli_exits_with_the_failing_code_when_the_others_wait_in_a_collective(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(textwrap.dedent(EARLY_FAILURE))
    started = time.monotonic()
    env = marked_env()
    failed = subprocess.run([sys.executable, "-m", "pathways", "spmd", "--timeout", "60", "2", str(script)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode == 1, failed.stderr  # the failing process's code, not the timeout's 124
    assert "process 1 exited with code 1" in failed.stderr
    assert "after the failure" in failed.stderr and "after 60 s" not in failed.stderr, failed.stderr
    assert time.monotonic() - started < 45
    assert not marked_processes(env), "the command left processes behind"


UNEVEN_FINISH = """
import time
import jax

jax.devices()
if jax.process_index() == 1:
    time.sleep(2)  # rank 0, which holds the group's coordination service, is done by now
print("process", jax.process_index(), "done")
"""


def test_cli_lets_every_process_finish_when_the_first_finishes_early(tmp_path):
    # The coordination service lives in process 0: were it to exit as soon as its script is
    # done, the others would lose it and abort, though their scripts never failed.
    script = tmp_path / "uneven.py"
    script.write_text(textwrap.dedent(UNEVEN_FINISH))
    env = marked_env()
    done = subprocess.run([sys.executable, "-m", "pathways", "spmd", "--timeout", "60", "2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] process 0 done", "[1] process 1 done"]
    assert not marked_processes(env), "the command left processes behind"
