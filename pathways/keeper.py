"""The process a worker host runs as: it starts the worker itself as its child and starts it
again when the worker asks to be restarted, or when JAX killed it.

A worker restarts when its island lost a host (a new ``jax.distributed`` group needs a new
process: JAX cannot leave a group and join another in-process) and when its controller went
away (it waits for the controller to come back, ``--reconnect-timeout``). JAX also kills the
hosts of a group itself, with SIGABRT, when the group's coordination service fails: rank 0
died, or this host was cut off from it. The keeper restarts the worker in those cases, so
that the host joins its island again once the island or the network is back; a worker that
exits otherwise (stopped, refused, killed by another signal) ends the keeper with its code,
so that whatever supervises the host (a local cluster, Slurm, Kubernetes) sees it.

Run as a script, ``python -I keeper.py RECONNECT_TIMEOUT COMMAND...`` (``command``): it uses
only the standard library, so it costs a few MiB, not a JAX import. SIGTERM and SIGINT are
passed on to the worker; the worker exits when the keeper does (PATHWAYS_PARENT_PID).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

RECONNECT_TIMEOUT = 60.0  # the default of `pathways worker --reconnect-timeout`
RESTART = 75  # the worker's exit code asking for a restart now (its island lost a host)
RECONNECT = 76  # ... asking for a restart that waits for the controller (it went away)
KEPT_ENV = "PATHWAYS_WORKER_KEPT"  # set in the worker: it exits with the codes above instead of stopping
RECONNECT_UNTIL_ENV = "PATHWAYS_RECONNECT_UNTIL"  # wall-clock time until which a restarted worker waits
PARENT_PID_ENV = "PATHWAYS_PARENT_PID"
LOG_LEVEL_ENV = "PATHWAYS_LOG_LEVEL"  # set by `pathways --log-level` for its children
CPP_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
GRPC_VERBOSITY_ENV = "GRPC_VERBOSITY"
_STOP_GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.5  # how often a wait for the worker looks whether the keeper is stopping
# Back-off between restarts after SIGABRT: the first comes soon (the island waits for this
# host to join it again), the next ones later, in case its coordination keeps failing.
_ABORT_PAUSE, _ABORT_MAX_PAUSE = 0.25, 10.0
_ABORT_STABLE_SECONDS = 30.0  # a worker that ran this long before aborting restarts after the first pause


def cpp_log_env(level: str) -> dict[str, str]:
    """The environment that sets the C++ log levels of a process logging at ``level``
    (PATHWAYS_LOG_LEVEL's form): XLA and its coordination service (TF_CPP_MIN_LOG_LEVEL:
    start-up notices, warnings such as the coordination service's "recoverable task"
    notice on an island's first host) and gRPC's core (GRPC_VERBOSITY: connection notices
    such as a GOAWAY from a host that stopped first) show at info and debug only, errors
    always. Both are read once, when the library loads, so they are set in a child's
    environment, whatever they were: JAX sets TF_CPP_MIN_LOG_LEVEL on import."""
    verbose = level.strip().upper() in ("INFO", "DEBUG", "NOTSET")
    return {CPP_LOG_LEVEL_ENV: "0" if verbose else "2", GRPC_VERBOSITY_ENV: "INFO" if verbose else "ERROR"}


def command(reconnect_timeout: float, worker: list[str]) -> list[str]:
    """The command line of a keeper of the worker started by ``worker``."""
    return [sys.executable, "-I", os.path.abspath(__file__), repr(reconnect_timeout), *worker]


def exit_with_parent() -> None:
    """In a child of a local cluster (or of a keeper): exit as soon as the parent process
    named by PARENT_PID_ENV is gone (``parent_gone``, which the keeper checks in its own wait
    loop instead: it forks its worker, so it must not start a thread). Here, in the
    standard-library-only module; every child of the package's processes uses it (cluster.py).

    A parent-death signal would not do: it follows the thread that forked, and trio
    forks from short-lived worker threads.
    """
    orphaned = parent_gone()
    if orphaned is None:
        return

    def watch() -> None:
        while not orphaned():
            time.sleep(0.25)
        os._exit(1)

    # lives as long as the process: it is what ends it
    threading.Thread(target=watch, name="pathways-parent-watch", daemon=True).start()


def parent_gone() -> Callable[[], bool] | None:
    """Whether the parent process named by PARENT_PID_ENV is gone, as a check to call again
    and again; None where no parent is named."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return None
    return lambda: os.getppid() != int(parent)


def main(argv: list[str], start: Callable[[list[str], dict[str, str]], Any] | None = None) -> int:
    """Keep the worker ``argv[1:]`` (``argv[0]``: the reconnect timeout) running; its exit
    status. ``start(command, env)`` starts it and returns a ``subprocess.Popen``-like child
    (default: a new process; a process template forks it instead, template.py)."""
    reconnect_timeout, command = float(argv[0]), argv[1:]
    start = start or (lambda command, env: subprocess.Popen(command, env=env))
    # The keeper watches its parent in its own wait loop, not on a thread (exit_with_parent):
    # a template's keeper forks its worker, and a fork must come from a single-threaded process.
    orphaned = parent_gone() or (lambda: False)
    env = {**os.environ, KEPT_ENV: "1", PARENT_PID_ENV: str(os.getpid()),
           **cpp_log_env(os.environ.get(LOG_LEVEL_ENV, ""))}
    env.pop(RECONNECT_UNTIL_ENV, None)
    child: subprocess.Popen | None = None
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    pause = _ABORT_PAUSE
    while not stopping:
        started = time.monotonic()
        child = start(command, env)
        kill_at = None
        while True:
            try:
                code = child.wait(timeout=_POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if orphaned():  # as exit_with_parent: the worker follows (its parent is this keeper)
                    os._exit(1)
                if stopping:  # the worker was passed the signal; JAX may ignore SIGTERM
                    kill_at = kill_at or time.monotonic() + _STOP_GRACE_SECONDS
                    if time.monotonic() > kill_at:
                        child.kill()
        env.pop(RECONNECT_UNTIL_ENV, None)
        if stopping:
            return code if code >= 0 else 128 - code
        if code == RESTART:
            continue
        if code == RECONNECT or code == -signal.SIGABRT:
            if code == -signal.SIGABRT:
                print(f"pathways worker: JAX ended the worker (pid {child.pid}; its island's coordination service "
                      "failed); starting it again", file=sys.stderr, flush=True)
                pause = _ABORT_PAUSE if time.monotonic() - started >= _ABORT_STABLE_SECONDS else pause
                time.sleep(pause)
                pause = min(2 * pause, _ABORT_MAX_PAUSE)
            if reconnect_timeout > 0:
                env[RECONNECT_UNTIL_ENV] = repr(time.time() + reconnect_timeout)
                continue
        if code < 0:  # a signal ends a process without a word: say which, for whoever reads the host's log
            print(f"pathways worker: the worker (pid {child.pid}) was ended by {_signal_name(-code)}",
                  file=sys.stderr, flush=True)
        return code if code >= 0 else 128 - code
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
