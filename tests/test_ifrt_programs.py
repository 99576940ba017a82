"""Unmodified JAX programs (tests/ifrt_programs.py: no pathways import) on pathways through
the IFRT proxy, compared result by result with the same programs on local CPU JAX.

One local cluster of two islands (2 hosts x 1 device, 1 host x 2 devices) with the IFRT
front end serves every test of this module. Each program runs under ``JAX_PLATFORMS=proxy``
and once on local CPU JAX with four host devices, every program of one way of running in
one subprocess (a program that raises fails only its own tests); the proxy's
devices are numbered island by island and host by host, so device index i is the same
logical place in both runs. Results must be bit-identical, except ``approx_`` ones (float
reductions), which must agree to 1e-6.

The proxy backend is registered three ways: by ``pathways.ifrt.plugin.initialize()`` called
before the program runs (every program), by ``pathwaysutils.initialize()`` with no pathways
code in the client at all, and by the ``jax_plugins`` entry point the package declares, with
no import at all (a subset each).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Iterable

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from tests import ifrt_programs
from tests.conftest import pids_alive, wait_until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(ifrt_programs.__file__).resolve()
ISLANDS = (pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=2))
DEVICES = sum(i.hosts * i.devices_per_host for i in ISLANDS)
PROGRAM_TIMEOUT = 600.0  # one program, JAX's start included, on a shared 2-core machine
CLEANUP_TIMEOUT = 60.0
SUBSET = ("devices", "jit_elementwise", "train_optax")
TOLERANCE = 1e-6

# Runs the program named on its command line after registering the proxy backend.
_REGISTER = {
    "plugin": "from pathways.ifrt import plugin; plugin.initialize()",
    "pathwaysutils": "import pathwaysutils; pathwaysutils.initialize()",
}
_RUN = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

pytestmark = pytest.mark.timeout(1800)


def _env(**overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XLA_FLAGS", "PYTHONPATH",
                        "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS")}
    env.update({k: v for k, v in overrides.items() if v is not None})
    return env


def local_env() -> dict[str, str]:
    return _env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")


def proxy_env(target: str, pythonpath: str | None = None, **extra: str) -> dict[str, str]:
    return _env(JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=target, PYTHONPATH=pythonpath, **extra)


def command(program: str, out: Path, register: str | None, *more: tuple[str, Path]) -> list[str]:
    """The program as a plain script, or run after one of the ``_REGISTER`` lines; ``more``
    programs after it in the same process."""
    args = [str(SCRIPT), program, str(out), *(str(a) for pair in more for a in pair)]
    if register is None:
        return [sys.executable, *args]
    return [sys.executable, "-c", f"{_REGISTER[register]}\n{_RUN}", *args]


def start(program: str, out: Path, env: dict[str, str], register: str | None = None,
          *more: tuple[str, Path]) -> subprocess.Popen:
    return subprocess.Popen(command(program, out, register, *more), env=env, cwd=str(out.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, what: str, outs: Iterable[Path] = ()) -> None:
    """Wait for programs started by :func:`start`; AssertionError with their output if they
    ran past PROGRAM_TIMEOUT, or failed otherwise than by programs that raised (each
    leaving its traceback beside its results, in ``outs``)."""
    try:
        output, _ = proc.communicate(timeout=PROGRAM_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"{what} ran past {PROGRAM_TIMEOUT:.0f} s; its output ends:\n{output[-4000:]}") from None
    outs = list(outs)
    reported = outs and all(out.exists() or Path(ifrt_programs.error_path(out)).exists() for out in outs)
    assert proc.returncode == 0 or (proc.returncode == 1 and reported), (
        f"{what} exited with code {proc.returncode}; its output ends:\n{output[-6000:]}")


def compare(program: str, got_path: Path, want_path: Path) -> None:
    """Every result of ``got_path`` equals local JAX's in ``want_path``: same keys, dtypes and
    shapes; bit-identical, or to 1e-6 for ``approx_`` keys."""
    got, want = np.load(got_path), np.load(want_path)
    assert sorted(got.files) == sorted(want.files), (
        f"{program}: results {sorted(set(got.files) ^ set(want.files))} are in only one of the runs")
    problems = []
    for key in sorted(want.files):
        if key.startswith("meta_"):
            continue
        g, w = got[key], want[key]
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            problems.append(f"{key}: {g.dtype}{list(g.shape)} under the proxy, {w.dtype}{list(w.shape)} locally")
        elif key.startswith("approx_"):
            if not np.allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, equal_nan=True):
                err = np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))
                problems.append(f"{key}: differs by up to {err:.3g} (tolerance {TOLERANCE:g})")
        elif g.tobytes() != w.tobytes():
            problems.append(f"{key}: not bit-identical: proxy {_short(g)}, local {_short(w)}")
    assert not problems, f"{program}: {len(problems)} results differ from local JAX:\n" + "\n".join(problems)


def _short(a: np.ndarray) -> str:
    text = np.array2string(a.ravel()[:8], precision=9, separator=",")
    return text if a.size <= 8 else f"{text[:-1]}, ...] ({a.size} values)"


@pytest.fixture(scope="module")
def cluster():
    with pw.local_cluster(islands=list(ISLANDS), ifrt=True) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


# How each test runs its programs under the proxy: the backend registered by
# pathways.ifrt.plugin.initialize(), by pathwaysutils, or by the jax_plugins entry point.
_WAY_OF_TEST = {"test_program_matches_local_jax": "plugin", "test_through_pathwaysutils": "pathwaysutils",
                "test_through_the_entry_point_with_no_import": "entry_point"}
_WHAT = {"local": "on local JAX", "plugin": "under the proxy", "pathwaysutils": "through pathwaysutils",
         "entry_point": "through the jax_plugins entry point"}


def _how(way: str, ifrt_address: str, directory: Path) -> tuple[dict[str, str], str | None]:
    """(environment, registration) of a process running programs ``way`` against the proxy
    at ``ifrt_address``."""
    if way == "local":
        return local_env(), None
    if way == "plugin":
        return proxy_env(ifrt_address, str(ROOT)), "plugin"
    if way == "pathwaysutils":
        # no pathways code in the client: pathwaysutils registers the backend; it needs the
        # credentials switch from the user's environment, as on Pathways on Cloud
        return proxy_env(ifrt_address, IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true"), "pathwaysutils"
    return proxy_env(ifrt_address, entry_point_path(directory / "site")), None


def _program_of(item: pytest.Item, way: str) -> str | None:
    """The program whose results, run ``way``, the test ``item`` uses."""
    if item.originalname == "test_two_ifrt_clients_and_a_native_client_at_once":
        return "concurrent" if way == "local" else None
    if way != "local" and _WAY_OF_TEST.get(item.originalname) != way:
        return None
    return getattr(item, "callspec", None) and item.callspec.params.get("program")


@pytest.fixture(scope="module")
def results(request, tmp_path_factory, cluster):
    """``results(way, program)``: the path of the program's results run ``way`` (a key of
    ``_WHAT``). The first call for a way runs, in one process, every program that this run's
    tests of the module need that way; a program that raised fails only its own tests, a
    process that failed otherwise (a crash, a timeout) every test of its way, once."""
    directory = tmp_path_factory.mktemp("results")
    done: dict[str, dict[str, Path] | AssertionError] = {}

    def get(way: str, program: str) -> Path:
        if way not in done:
            needed = sorted({program, *(_program_of(item, way) for item in request.session.items
                                        if item.module is request.module)} - {None})
            paths = {name: directory / f"{way}-{name}.npz" for name in needed}
            env, register = _how(way, cluster.ifrt_address, directory)
            first, *rest = paths.items()
            try:
                finish(start(*first, env, register, *rest), f"{needed} {_WHAT[way]}", paths.values())
                done[way] = paths
            except AssertionError as e:
                done[way] = e
        if isinstance(done[way], AssertionError):
            raise done[way]
        path = done[way][program]
        error = Path(ifrt_programs.error_path(path))
        if error.exists():
            raise AssertionError(f"{program!r} {_WHAT[way]} raised:\n{error.read_text()[-6000:]}")
        return path

    return get


@pytest.fixture
def ifrt_cleanup(cluster):
    """After the test: every IFRT session and array it made is gone from the cluster once
    its programs have exited."""
    before = status(cluster.address)
    sessions = {s["session"] for s in before["sessions"]}
    yield

    def clean():
        now = status(cluster.address)
        return {s["session"] for s in now["sessions"]} <= sessions and now["arrays"] == before["arrays"]

    wait_until(clean, CLEANUP_TIMEOUT, "the IFRT sessions of exited programs and their arrays to be released")


def entry_point_path(directory: Path) -> str:
    """A folder making the package's ``jax_plugins`` entry point (declared in pyproject.toml)
    visible to importlib.metadata, as installing the package does, and the repository."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project.get("entry-points", {}).get("jax_plugins", {})
    assert plugins, "pyproject.toml declares no [project.entry-points.jax_plugins]"
    info = directory / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("[jax_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    return os.pathsep.join([str(directory), str(ROOT)])


PROGRAMS = [name for name in ifrt_programs.PROGRAMS if name != "concurrent"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_program_matches_local_jax(program, results, ifrt_cleanup):
    compare(program, results("plugin", program), results("local", program))


@pytest.mark.parametrize("program", SUBSET)
def test_through_pathwaysutils(program, results, ifrt_cleanup):
    compare(program, results("pathwaysutils", program), results("local", program))


@pytest.mark.parametrize("program", SUBSET)
def test_through_the_entry_point_with_no_import(program, results, ifrt_cleanup):
    compare(program, results("entry_point", program), results("local", program))


def test_two_ifrt_clients_and_a_native_client_at_once(cluster, results, tmp_path, ifrt_cleanup):
    """Two proxy clients run collectives across island 0's two hosts while this process's
    native session runs its own on a slice of the same island; all three are correct and
    their runs overlap in time."""
    want = results("local", "concurrent")
    stop = tmp_path / "stop"
    env = proxy_env(cluster.ifrt_address, str(ROOT), **{ifrt_programs.STOP_ENV: str(stop)})
    outs = [tmp_path / f"client{k}.npz" for k in range(2)]
    procs = [start("concurrent", out, env, "plugin") for out in outs]
    try:
        island0 = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
        assert len(island0.workers) == 2, f"the native slice should span island 0's two hosts, got {island0.workers}"
        f = pw.jit(lambda v: (v * v).sum(axis=0) + 1.0, mesh=island0.mesh(("x",)), in_shardings=(pw.P("x"),))
        native_times = []
        deadline = time.monotonic() + PROGRAM_TIMEOUT
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            both_running = len(ifrt_programs.started(stop)) == len(procs)
            k = len(native_times)
            x = np.arange(8, dtype=np.float32).reshape(4, 2) + k
            np.testing.assert_array_equal(np.asarray(f(x)), (x * x).sum(axis=0) + 1.0,
                                          err_msg=f"the native client's call {k} while the IFRT clients ran")
            native_times.append(time.time())
            if both_running:
                stop.touch()  # a native call ran from start to end while both IFRT clients looped
    finally:
        for k, proc in enumerate(procs):
            finish(proc, f"IFRT client {k}")
    runs = [np.load(out) for out in outs]
    for k, out in enumerate(outs):
        compare(f"concurrent (IFRT client {k})", out, want)
        assert runs[k]["repeats_equal"], f"IFRT client {k}: a repeated call gave a different result"
    start_both = max(float(r["meta_start"]) for r in runs)
    end_first = min(float(r["meta_end"]) for r in runs)
    assert start_both < end_first, "the two IFRT clients did not run at the same time"
    overlapping = [t for t in native_times if start_both < t < end_first]
    assert overlapping, "no native call completed while both IFRT clients ran"
