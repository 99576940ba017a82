"""GPU workers: a worker started with ``--platform cuda`` beside a CPU worker, as an operator
starts them. A ``gpu_devices`` slice runs jit and a psum, arrays move between the GPU worker
and the CPU worker both ways, and an unmodified JAX program runs on the GPU through the IFRT
proxy. Skipped, saying why, where JAX finds no NVIDIA GPU (it needs one and ``pip install
'jax[cuda12]'``)."""

import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import stop_processes, wait_for_workers
from pathways.defaults import ADDRESS_LINE, IFRT_LINE
from tests.conftest import read_line
from tests.test_ifrt_cli import entry_point, proxy_env, run_script  # noqa: F401 - entry_point is a fixture

START = 180.0
# The device files of NVIDIA's driver: without them no process here can use a GPU, and the
# module skips before paying for a JAX probe.
HAS_DRIVER = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
pytestmark = pytest.mark.skipif(not HAS_DRIVER, reason="no NVIDIA GPU driver on this machine (no /dev/nvidiactl, "
                                                       "no nvidia-smi): the GPU tests need an NVIDIA GPU")


CUDA_PROBE = """
import jax
try:
    print(len(jax.devices("cuda")))
except Exception as e:
    print(f"{type(e).__name__}: {e}"[:300] if str(e) else f"{type(e).__name__}: JAX has no CUDA backend")
"""


@pytest.fixture(scope="module")
def gpus():
    """How many CUDA devices JAX finds here (in a process of its own, as a worker would)."""
    probe = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=START,
                           env={**os.environ, "JAX_PLATFORMS": "cuda"})
    found = (probe.stdout.strip().splitlines() or [f"no answer (exit code {probe.returncode})"])[-1]
    if not found.isdigit():
        pytest.skip(f"JAX finds no CUDA GPU here ({found}); install 'jax[cuda12]'")
    return int(probe.stdout.split()[-1])


@pytest.fixture(scope="module")
def cluster(gpus):
    """A controller serving the IFRT proxy, a CUDA worker (island "gpu") and a CPU worker of
    two devices (island "cpu"): (controller address, IFRT proxy address)."""
    controller = subprocess.Popen([sys.executable, "-m", "pathways", "controller", "--ifrt-bind", "127.0.0.1:0"],
                                  stdout=subprocess.PIPE, text=True)
    procs = [controller]
    try:
        first, second = read_line(controller, START).split(), controller.stdout.readline().split()
        assert first[0] == ADDRESS_LINE and second[0] == IFRT_LINE, (first, second)
        address, ifrt = first[1], second[1]
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the GPU may be shared
        for island, flags in (("gpu", ["--platform", "cuda"]), ("cpu", ["--platform", "cpu", "--devices", "2"])):
            procs.append(subprocess.Popen([sys.executable, "-m", "pathways", "worker", "--controller", address,
                                           "--island", island, "--launcher", "none", *flags], env=env))
        wait_for_workers(address, 2, START)
        yield address, ifrt
    finally:
        for proc in procs[1:]:
            proc.send_signal(signal.SIGTERM)
        stop_processes(procs[::-1])


@pytest.fixture
def session(cluster):
    pw.connect(cluster[0])
    yield pw.default_session()
    pw.disconnect()


def test_a_gpu_slice_runs_jit_and_a_psum(gpus, session):
    s = pw.make_virtual_device_set().add_slice(gpu_devices=gpus)
    twice = pw.jit(lambda x: x * 2.0 + 1.0, mesh=s.mesh("d"))
    np.testing.assert_array_equal(np.asarray(twice(pw.device_put(np.arange(4.0, dtype=np.float32), s.devices))),
                                  [1.0, 3.0, 5.0, 7.0])
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
    np.testing.assert_array_equal(np.asarray(total(np.arange(1.0, gpus + 1, dtype=np.float32))),
                                  [gpus * (gpus + 1) / 2] * gpus)


def test_arrays_move_between_a_gpu_worker_and_a_cpu_worker_both_ways(session):
    gpu = pw.make_virtual_device_set().add_slice(gpu_devices=1)
    cpu = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    assert gpu.workers != cpu.workers
    on_gpu = pw.program(lambda x: pw.jit(lambda v: v * 2.0, mesh=gpu.mesh("d"))(x))
    on_cpu = pw.program(lambda x: pw.jit(lambda v: v + 1.0, mesh=cpu.mesh("d"))(x))
    values = np.arange(4.0, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(on_gpu(pw.device_put(values, cpu.devices))), values * 2.0)
    np.testing.assert_array_equal(np.asarray(on_cpu(pw.device_put(values, gpu.devices))), values + 1.0)


def test_an_unmodified_jax_program_runs_on_the_gpu_through_the_ifrt_proxy(cluster, entry_point):  # noqa: F811
    code = """
        import jax, jax.numpy as jnp
        print(len(jax.devices()), float(jax.jit(lambda v: (v * 2.0).sum())(jnp.arange(4.0))))
    """
    out = run_script(code, proxy_env(cluster[1], entry_point, PATHWAYS_SLICE="gpu:1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "12.0"], out.stdout
