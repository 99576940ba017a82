"""``python -m pathways run script.py``: an unmodified JAX script on an embedded local cluster.

The cluster's controller serves the IFRT proxy protocol on a free loopback port; the script
runs as a child process with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET`` naming that
port, so every ``jit``, ``device_put`` and ``np.asarray`` of it goes to the cluster. JAX
finds the ``proxy`` backend through this package's ``jax_plugins`` entry point
(pathways/ifrt/plugin.py). So that this works from a source tree too, not installed, the
child gets the entry point from a distribution record in a temporary folder on its
PYTHONPATH, which is what installing writes (installed, JAX sees the same module twice
and loads it once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Optional, Sequence

from pathways import config
from pathways.cluster import Island, LocalCluster, child_log_env, stop_processes
from pathways.ifrt import plugin
from pathways.wire import security as sec
from pathways.wire.security import Security

ENTRY_POINT_GROUP = "jax_plugins"
ENTRY_POINT = "pathways = pathways.ifrt.plugin"  # as pyproject.toml declares it
_DIST = "pathways_jax_plugin-0.dist-info"
_POLL_SECONDS = 0.2
# After Ctrl-C, how long the script may take to exit by itself before it is interrupted
# again (the interrupt reached only this process), and then before it is stopped.
_FORWARD_SECONDS = 1.0
_INTERRUPT_GRACE_SECONDS = 5.0


def write_entry_point(folder: str | os.PathLike) -> Path:
    """Write into ``folder`` the distribution record (a ``.dist-info`` with
    ``entry_points.txt``) that advertises pathways.ifrt.plugin to JAX, as installing the
    package does; a process with ``folder`` on its PYTHONPATH finds the ``proxy`` backend
    with no import of pathways. Returns ``folder``."""
    dist = Path(folder) / _DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways-jax-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT}\n")
    return Path(folder)


def script_env(base: dict[str, str], target: str, security: Security, paths: Sequence[str]) -> dict[str, str]:
    """``base`` for a script run under the proxy at ``target`` (``grpc://HOST:PORT``):
    JAX_PLATFORMS, JAX_BACKEND_TARGET, plain gRPC credentials, the cluster's token (and no
    other), ``paths`` first on PYTHONPATH, and the C++ log level of this process's children."""
    env = sec.child_env(security, base)
    # the C++ client's notices (plain credentials in use, the server gone at exit) follow
    # --log-level as the cluster's do (JAX sets TF_CPP_MIN_LOG_LEVEL in this process on import)
    env.update(child_log_env())
    env["JAX_PLATFORMS"] = plugin.PLATFORM
    env["JAX_BACKEND_TARGET"] = target
    env[plugin.INSECURE_ENV] = "true"  # what the plugin sets too; here also for pathwaysutils' factory
    env.pop(config.ADDRESS.name, None)  # the script's cluster is this one
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [base.get("PYTHONPATH")])])
    return env


def _package_root() -> str:
    """The folder holding the ``pathways`` package, so that the child imports this one."""
    return str(Path(__file__).resolve().parents[2])  # .../pathways/ifrt/launch.py


def run_script(islands: Sequence[Island], script: str, args: Sequence[str] = (),
               security: Optional[Security] = None, timeout: Optional[float] = None,
               restart_workers: bool = True, session_memory: Optional[int] = None) -> int:
    """Start a local cluster with the IFRT proxy front end, run ``script`` with ``args``
    under it, stop the cluster, and return the script's exit code (128 + N when signal N
    ended it or this process; 124 after ``timeout`` seconds; 1 when the cluster's controller
    died under it). ``restart_workers`` and ``session_memory``: as LocalCluster's. Raises FileNotFoundError when
    ``script`` is not a file."""
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such script: {script!r}")
    security = security or Security()
    cluster = LocalCluster(islands, security=security, ifrt_port=0, restart_workers=restart_workers,
                           session_memory=session_memory)
    # SIGTERM (a job scheduler, `kill`) stops the script and the cluster as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, _terminate)
    child: Optional[subprocess.Popen] = None
    try:
        with tempfile.TemporaryDirectory(prefix="pathways-run-") as shim:
            cluster.start()
            assert cluster.ifrt_address is not None  # started with ifrt_port
            print(f"pathways run: cluster up at {cluster.address}, IFRT proxy at {cluster.ifrt_address}",
                  file=sys.stderr, flush=True)
            env = script_env(dict(os.environ), cluster.ifrt_address, security,
                             [str(write_entry_point(shim)), _package_root()])
            child = subprocess.Popen([sys.executable, script, *args], env=env)
            return _wait(child, cluster, timeout)
    except _Terminated:
        return 128 + signal.SIGTERM  # the script is stopped below
    except KeyboardInterrupt:
        if child is not None:
            _let_finish(child)
        return 128 + signal.SIGINT
    finally:
        if child is not None:
            stop_processes([child])
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """This process got SIGTERM."""


def _terminate(signum: int, frame: Optional[types.FrameType]) -> None:
    raise _Terminated


def _let_finish(child: subprocess.Popen) -> None:
    """After Ctrl-C: the terminal interrupted the script too; give it a grace period to end
    as it would alone (an interrupt sent to this process only is passed on to it)."""
    try:
        child.wait(_FORWARD_SECONDS)
        return
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)
    try:
        child.wait(_INTERRUPT_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass  # stopped by the caller


def _wait(child: subprocess.Popen, cluster: LocalCluster, timeout: Optional[float]) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            code = child.wait(_POLL_SECONDS)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if cluster.controller_exited.is_set():
            print(f"pathways run: the cluster's controller exited with code {cluster.controller_code} while "
                  "the script ran; stopping the script", file=sys.stderr)
            return 1
        if deadline is not None and time.monotonic() > deadline:
            print(f"pathways run: the script still ran after --timeout {timeout:g} s; stopping it", file=sys.stderr)
            return 124
