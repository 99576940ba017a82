"""The parent side of multi-controller mode: start N processes that join one ``jax.distributed``
group, send each the same function, gather the results, and tear the group down.

Every process runs the same call on its own devices, as in classic multi-controller JAX;
collectives run over gloo. A group survives calls that fail the same way everywhere; when
one process fails or dies while others are still running (they may be waiting in a
collective for it), the whole group is stopped, since it cannot continue.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

import cloudpickle

from pathways import config
from pathways.cluster import child_log_env, stop_processes
from pathways.errors import DeadlineExceededError, SpmdError
from pathways.spmd._messages import Call, Died, Exit, Raised, Ready, Reply, Returned
from pathways.wire.addresses import PortReservation

_GRACE_SECONDS = 3.0
_FAILURE_GRACE_SECONDS = 5.0  # how long the others may take to report after one process failed
_TAIL_LINES = 40
_CHILD_MAIN = "from pathways.spmd._child import main; main()"


class _Output(threading.Thread):
    """Forwards one child stream line by line, prefixed with its rank, keeping a tail for
    error messages."""

    def __init__(self, stream, rank: int, sink, echo: bool):
        super().__init__(name=f"pathways-spmd-output-{rank}", daemon=True)
        self.stream, self.rank, self.sink, self.echo = stream, rank, sink, echo
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.start()

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if self.echo:
                try:
                    self.sink().write(f"[{self.rank}] {line}\n")
                    self.sink().flush()
                except ValueError:  # the sink was closed (e.g. test capture ended)
                    pass
        self.stream.close()


class _Group:
    """N child processes of one jax.distributed group, their output and, in pool mode, their
    control connections."""

    def __init__(self, num_processes: int, devices_per_process: int, argv: Sequence[str],
                 with_connections: bool, echo: bool, init_timeout: float):
        if num_processes < 1 or devices_per_process < 1:
            raise ValueError(f"num_processes and devices_per_process must be >= 1, got {num_processes} "
                             f"and {devices_per_process}")
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.outputs: list[_Output] = []
        # Held until the group ends, so that no other process takes the port before rank 0's
        # coordination service binds it.
        self._port = PortReservation("127.0.0.1")
        coordinator = f"127.0.0.1:{self._port.port}"
        try:
            for rank in range(num_processes):
                env = {**os.environ, config.PARENT_PID.name: str(os.getpid()), **child_log_env(),
                       config.SPMD_COORDINATOR.name: coordinator, config.SPMD_PROCESSES.name: str(num_processes),
                       config.SPMD_RANK.name: str(rank), config.SPMD_DEVICES.name: str(devices_per_process),
                       config.SPMD_INIT_TIMEOUT.name: str(init_timeout)}
                env.pop(config.SPMD_FD.name, None)
                # The same modules as the caller, so that functions sent by reference import.
                env["PYTHONPATH"] = os.pathsep.join([*(p or os.getcwd() for p in sys.path),
                                                     *filter(None, [os.environ.get("PYTHONPATH")])])
                pass_fds: tuple[int, ...] = ()
                child_end = None
                if with_connections:
                    parent_end, child_end = socket.socketpair()
                    self.conns.append(Connection(parent_end.detach()))
                    env[config.SPMD_FD.name] = str(child_end.fileno())
                    pass_fds = (child_end.fileno(),)
                try:
                    proc = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN, *argv], env=env,
                                            pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                finally:
                    if child_end is not None:
                        child_end.close()
                self.procs.append(proc)
                self.outputs.append(_Output(proc.stdout, rank, lambda: sys.stdout, echo))
                self.outputs.append(_Output(proc.stderr, rank, lambda: sys.stderr, echo))
        except BaseException:
            self.kill()
            raise
        self._finalizer = weakref.finalize(self, stop_processes, list(self.procs))

    def tail(self, rank: int) -> str:
        lines = [*self.outputs[2 * rank].tail, *self.outputs[2 * rank + 1].tail]
        return "\n".join(lines[-_TAIL_LINES:])

    def kill(self, grace: float = _GRACE_SECONDS) -> None:
        """Stop every process: SIGTERM, then SIGKILL after ``grace`` (JAX processes may ignore
        SIGTERM), and reap them."""
        stop_processes(self.procs, grace)
        self._port.close()
        for conn in self.conns:
            conn.close()
        for out in self.outputs:
            out.join(timeout=1.0)


class Pool:
    """``num_processes`` processes with ``devices_per_process`` CPU devices each, joined in one
    ``jax.distributed`` group, kept alive across calls (start-up costs seconds)::

        with pw.spmd.Pool(2) as pool:
            loss = pool.run(train, args=(params, data))

    ``fn`` is sent with cloudpickle, so lambdas and closures work; it runs in every process
    and should build its mesh from all devices (``pw.spmd.mesh``). ``echo`` forwards the
    processes' output, each line prefixed with its rank. ``processes``: what each process
    said of its place once the group was up (its index, the group's and its own device counts).
    """

    def __init__(self, num_processes: int, devices_per_process: int = 1, *, start_timeout: float = 120.0,
                 echo: bool = True):
        self.num_processes = num_processes
        self.devices_per_process = devices_per_process
        self._group: Optional[_Group] = _Group(num_processes, devices_per_process, (), True, echo, start_timeout)
        try:
            self.processes: list[Ready] = self._gather(start_timeout, "start")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The group's process ids, in rank order."""
        return [p.pid for p in self._live().procs]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
            timeout: float = 600.0) -> Any:
        """``fn(*args, **kwargs)`` in every process; returns process 0's result, with every
        ``jax.Array`` as the numpy value of the whole array."""
        return self.run_all(fn, args, kwargs, timeout)[0]

    def run_all(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
                timeout: float = 600.0) -> list[Any]:
        """Like :meth:`run`, but returns every process's result, in rank order."""
        group = self._live()
        try:
            payload = cloudpickle.dumps(Call(fn, tuple(args), dict(kwargs or {})))
        except Exception as e:
            raise SpmdError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the processes: {e}; "
                            "pass picklable values (numpy arrays, not pathways or jax arrays)") from e
        for conn in group.conns:
            conn.send_bytes(payload)
        return self._gather(timeout, f"{getattr(fn, '__name__', 'the function')}()")

    def close(self) -> None:
        """Ask every process to exit, then stop those that do not within a grace period."""
        group, self._group = self._group, None
        if group is None:
            return
        for conn in group.conns:
            try:
                conn.send_bytes(cloudpickle.dumps(Exit()))
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_SECONDS
        for p in group.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        group.kill()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self) -> _Group:
        if self._group is None:
            raise SpmdError("this spmd pool is closed (closed by the caller, or stopped after a process failed); "
                            "start a new pw.spmd.Pool")
        return self._group

    def _gather(self, timeout: float, what: str) -> list[Any]:
        """One reply per process. On a failure, waits briefly for the others, then raises."""
        group = self._live()
        replies: dict[int, Reply] = {}
        pending = {conn: rank for rank, conn in enumerate(group.conns)}
        deadline = time.monotonic() + timeout
        failed_at: Optional[float] = None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_SECONDS)
            ready = wait(list(pending), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    replies[rank] = cloudpickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    group.procs[rank].wait(timeout=_GRACE_SECONDS)
                    replies[rank] = Died(group.procs[rank].returncode)
                if not _answered(replies[rank]) and failed_at is None:
                    failed_at = time.monotonic()
        if not pending and all(_answered(r) for r in replies.values()):
            return [_value(replies[rank]) for rank in range(len(group.conns))]
        self._fail(group, replies, pending.values(), what, timeout)
        raise AssertionError("unreachable")  # _fail raises

    def _fail(self, group: _Group, replies: dict[int, Reply], missing, what: str, timeout: float) -> None:
        missing = sorted(missing)
        errors = {rank: r for rank, r in replies.items() if not _answered(r)}
        keep = not missing and all(isinstance(r, Raised) for r in errors.values())
        if not keep:  # processes still waiting, or dead: the group cannot go on
            self._group = None
            group.kill()
        if not errors:
            raise DeadlineExceededError(
                f"{what} did not finish within {timeout:g} s on process(es) {missing}; the spmd pool was stopped. "
                "Pass a larger timeout= if the work is expected to take longer")
        rank, reply = min(errors.items())
        if isinstance(reply, Raised):
            detail = f"{what} raised on process {rank}: {reply.kind}: {reply.message}\n{reply.traceback}"
        elif isinstance(reply, Died):
            detail = f"process {rank} exited with code {reply.code} during {what}; its last output:\n{group.tail(rank)}"
        else:
            detail = f"process {rank} answered {what} with {type(reply).__name__}, not its result"
        if missing:
            detail += f"\nprocess(es) {missing} did not answer (likely waiting in a collective) and were stopped"
        if not keep:
            detail += "\nthe spmd pool was stopped; start a new one"
        raise SpmdError(detail)


def _answered(reply: Reply) -> bool:
    """Whether ``reply`` is what was asked: a process's Ready at start, a call's Returned."""
    return isinstance(reply, (Ready, Returned))


def _value(reply: Reply) -> Any:
    return reply.value if isinstance(reply, Returned) else reply


def run(fn: Callable[..., Any], num_processes: int, devices_per_process: int = 1, args: Sequence[Any] = (),
        kwargs: Optional[dict] = None, timeout: float = 600.0, echo: bool = True) -> Any:
    """Run ``fn(*args, **kwargs)`` multi-controller: start ``num_processes`` processes with
    ``devices_per_process`` CPU devices each in one ``jax.distributed`` group, call ``fn`` in
    every one, stop them, and return process 0's result (``jax.Array`` leaves as numpy)."""
    with Pool(num_processes, devices_per_process, start_timeout=min(timeout, 120.0), echo=echo) as pool:
        return pool.run(fn, args, kwargs, timeout)


def launch(num_processes: int, script: str, argv: Sequence[str] = (), devices_per_process: int = 1,
           timeout: float = 3600.0) -> int:
    """``python -m pathways spmd N script.py``: run the script as ``__main__`` in every process
    of a new group (after ``jax.distributed.initialize``), forwarding output prefixed with
    the rank. Returns 0 when every process exits with 0, else the first failing code; when
    one fails, the others get a grace period and are then stopped."""
    if not os.path.isfile(script):
        raise SpmdError(f"no such script: {script!r}")
    group = _Group(num_processes, devices_per_process, (script, *argv), False, True, min(timeout, 120.0))
    code = 0
    deadline = time.monotonic() + timeout
    try:
        pending = set(range(num_processes))
        while pending:
            if time.monotonic() > deadline:
                if code:  # the grace after a failure ran out: the others wait for the failed one
                    print(f"pathways spmd: process(es) {sorted(pending)} still running "
                          f"{_FAILURE_GRACE_SECONDS:g} s after the failure (likely waiting in a collective); "
                          "stopping them", file=sys.stderr)
                    return code
                print(f"pathways spmd: {sorted(pending)} still running after {timeout:g} s; stopping",
                      file=sys.stderr)
                return 124
            for rank in sorted(pending):
                rc = group.procs[rank].poll()
                if rc is None:
                    continue
                pending.discard(rank)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc  # killed by a signal: the shell's convention
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_SECONDS)
                    print(f"pathways spmd: process {rank} exited with code {rc}", file=sys.stderr)
            time.sleep(0.05)
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        group.kill()
