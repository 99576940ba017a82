"""A controller and worker processes on this machine, supervised by trio (``pw.local_cluster``
connects a session to them), and queries of a running cluster's status.

A local cluster listens on loopback only: the controller binds 127.0.0.1, and workers,
which bind and advertise the address they reach the controller from, do too. Each island
is named by its index and its hosts take ranks in start order.

The supervisor runs in a background thread of the client process. Its processes are forked
by the client process's process template (template.py), which exits with the client; each
process watches its parent (PATHWAYS_PARENT_PID) and exits when it is gone, and on stop
(normal exit, error, Ctrl-C) every process is sent SIGTERM and, after a short grace, SIGKILL,
since processes running JAX may ignore SIGTERM. Every wait has a deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import grpc
import trio

from pathways.defaults import ADDRESS_LINE, DEFAULT_WINDOW, IFRT_LINE
from pathways.errors import ConnectError, DeadlineExceededError, PathwaysError, WireError
from pathways.protocol import operator
from pathways.protocol.messages import MeasureRequest, RetireRequest, pack
from pathways.wire import rpc
from pathways.wire import security as sec
from pathways.wire.security import Security
from pathways.wire.liveness import check_timeout
from pathways import config, keeper
from pathways.template import Template, template_for

if TYPE_CHECKING:
    from pathways.planner import Topology

log = logging.getLogger("pathways.cluster")

_GRACE_SECONDS = 3.0
# Between SIGTERM and SIGKILL for the controller, whose own stop is bounded but longer: its
# IFRT front end's sessions that ended just before may still be collecting their timelines
# (ifrt/server.py CLOSING_SECONDS, 8 s), then its streams end (5 s at most). Its worst case,
# the front end's whole bound (controller/server.py _IFRT_STOP_SECONDS, 15 s) and then the
# streams, is longer: SIGKILL cuts that one short.
_CONTROLLER_GRACE_SECONDS = 15.0
RESTART_FIRST_PAUSE = 0.5
RESTART_MAX_PAUSE = 10.0
RESTART_STABLE_SECONDS = 10.0  # a process that ran this long restarts after the first pause again
# Workers' fd 1 goes to the client's stderr: C++ libraries (gloo) print notices on stdout,
# which belongs to the user's program.
_STDERR_FD = 2


@dataclass(frozen=True)
class Island:
    """A group of worker hosts joined by the fast interconnect."""

    hosts: int = 1
    devices_per_host: int = 1


# What a cluster's processes import: its template imports them once, and forks each process
# from its image (template.py).
_PRELOAD = ("pathways.cli", "pathways.cli.controller", "pathways.cli.worker", "pathways.controller.server",
            "pathways.worker.server", "pathways.worker.core", "pathways.worker.cpu_kernels")


def _python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pathways", *args]


class _Forked:
    """A process a template forked for a cluster, with the part of ``trio.Process``'s
    interface the supervisor uses: its pid, command line, exit status and signals. The
    template is its parent; the supervisor waits on its pidfd and reads its exit status from
    the template."""

    def __init__(self, template: Template, pid: int, args: list[str], stdout: Optional[trio.lowlevel.FdStream]):
        self._template, self.pid, self.args, self.stdout = template, pid, args, stdout
        self.returncode: Optional[int] = None
        try:
            self._pidfd: Optional[int] = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: its status is on its way from the template
            self._pidfd = None

    async def wait(self) -> int:
        if self.returncode is None:
            if self._pidfd is not None:
                await trio.lowlevel.wait_readable(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = None
            code = await trio.to_thread.run_sync(self._template.exit_code, self.pid, _GRACE_SECONDS + 10)
            # no status: the template is gone (and so is the process, exit_with_parent)
            self.returncode = -signal.SIGKILL if code is None else code
            if self.stdout is not None:
                self.stdout.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                pass  # exited meanwhile; wait() collects its status


async def _start(command: list[str], env: dict[str, str], stdout: Optional[int]) -> _Forked:
    """``command`` forked by this process's template for ``env``; its stdout on descriptor
    ``stdout``, or on a pipe (``.stdout``) when None."""
    template = await trio.to_thread.run_sync(template_for, _PRELOAD, env)
    if stdout is not None:
        pid = await trio.to_thread.run_sync(template.spawn, command, env, stdout)
        return _Forked(template, pid, command, None)
    read, write = os.pipe()
    try:
        pid = await trio.to_thread.run_sync(template.spawn, command, env, write)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return _Forked(template, pid, command, trio.lowlevel.FdStream(read))


def child_log_env() -> dict[str, str]:
    """The environment that makes child processes log like this one: at PATHWAYS_LOG_LEVEL
    (or this process's level). Their C++ logs (XLA, its coordination service: start-up
    notices and warnings) and gRPC's follow it too: errors only, unless the level is INFO or
    DEBUG (keeper.cpp_log_env)."""
    level = config.LOG_LEVEL.text() or logging.getLevelName(logging.getLogger("pathways").getEffectiveLevel())
    return {config.LOG_LEVEL.name: level, **keeper.cpp_log_env(level)}


def free_port() -> int:
    """A free loopback port, released before it is returned (another process may take it
    before the caller binds it): an address where nothing listens. A port a server must
    bind later is reserved instead (``wire.addresses.PortReservation``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """A controller and workers on this machine. ``security``: the token and TLS settings
    every process of the cluster (and this process, to reach it) is given; none by default.
    Its controller and workers also share a worker token (``security.worker_token``, drawn
    at random where ``security`` has none): a worker started by hand for this cluster needs
    it (PATHWAYS_WORKER_TOKEN).
    ``ifrt_port``: the controller also serves the IFRT proxy protocol on this loopback port
    (0: any free one), at ``.ifrt_address`` (``grpc://127.0.0.1:PORT``); None: it does not.
    ``restart_workers`` (default): a worker that fails while the cluster runs (an error code, a
    signal, a crash) is started again, after a back-off (RESTART_FIRST_PAUSE, doubled for each
    restart of a process that ran less than RESTART_STABLE_SECONDS, at most RESTART_MAX_PAUSE),
    and its island heals; one that exits with code 0 was told to (``pathways retire``, or a
    controller stopped on purpose) and is not. False: a lost worker stays lost (the controller
    says so: ``--host-recovery none``).
    ``run_timeout``: seconds an island may have runs in flight and finish none before the
    controller resets it (``pathways controller --run-timeout``); None: never.
    ``restart_controller``: so is the controller, on the same address; the workers attach to
    it again on their own (``pathways worker --reconnect-timeout``)."""

    def __init__(self, islands: Sequence[Island], start_timeout: float = 120.0, policy: str = "fair",
                 window: int = DEFAULT_WINDOW, unsafe_local_order: bool = False,
                 security: Security | None = None, heartbeat_timeout: Optional[float] = None,
                 ifrt_port: Optional[int] = None, restart_workers: bool = True,
                 restart_controller: bool = False, suspend_dir: Optional[str] = None,
                 run_timeout: Optional[float] = None, session_memory: Optional[int] = None,
                 checkpoint_dir: Optional[str] = None, colocated_python: bool = False) -> None:
        if not islands or any(i.hosts < 1 or i.devices_per_host < 1 for i in islands):
            raise ValueError("a local cluster needs at least one island of hosts >= 1 and devices_per_host >= 1")
        if policy not in ("fair", "fifo") or window < 1:
            raise ValueError(f"policy must be 'fair' or 'fifo' and window >= 1, got {policy!r} and {window}")
        if session_memory is not None and session_memory < 0:
            raise ValueError(f"session_memory must be a number of bytes, 0 or more (0: no limit), got {session_memory}")
        if ifrt_port is not None and not 0 <= ifrt_port < 65536:
            raise ValueError(f"ifrt_port must be a port number, 0 to 65535 (0: any free port), got {ifrt_port}")
        self.islands = list(islands)
        self.start_timeout = start_timeout
        self.policy = policy
        self.window = window
        self.unsafe_local_order = unsafe_local_order
        security = security or Security()
        # its workers attach with a worker token of their own, drawn here where none is given,
        # so that holding the clients' token (or none, on loopback) attaches no worker
        self.security = security if security.worker_token else dataclasses.replace(
            security, worker_token=secrets.token_urlsafe(32))
        # None: the processes' default (defaults.HEARTBEAT_TIMEOUT)
        self.heartbeat_timeout = None if heartbeat_timeout is None else check_timeout(heartbeat_timeout,
                                                                                        "heartbeat_timeout")
        self.ifrt_port = ifrt_port
        self.suspend_dir = suspend_dir  # where the workers may write suspended sessions' files
        self.checkpoint_dir = checkpoint_dir  # where the workers may write and read clients' checkpoints
        self.colocated_python = colocated_python  # whether the workers run clients' colocated Python
        # bytes of arrays a session may hold on each worker (0: no limit); None: the workers' default
        self.session_memory = session_memory
        # seconds an island may go without finishing a run in flight before it is reset; None: never
        self.run_timeout = None if run_timeout is None else check_timeout(run_timeout, "run_timeout")
        self.restart_workers = restart_workers
        self.restart_controller = restart_controller
        self.restarts = 0  # processes the supervisor restarted
        self.address: Optional[str] = None
        self.ifrt_address: Optional[str] = None  # grpc://127.0.0.1:PORT once started with ifrt_port
        self.pids: list[int] = []
        self._ready = threading.Event()
        self._failure: Optional[str] = None
        self._stopping = False
        self._token: Optional[trio.lowlevel.TrioToken] = None
        self._cancel: Optional[trio.CancelScope] = None
        self._thread: Optional[threading.Thread] = None
        # Set when the controller exits while the cluster runs and is not restarted (controller_code
        # is its exit code): the cluster is then of no use (`pathways run` stops).
        self.controller_exited = threading.Event()
        self.controller_code: Optional[int] = None

    @classmethod
    def of_hosts(cls, hosts: int, devices_per_host: int, security: Security | None = None) -> "LocalCluster":
        return cls([Island(hosts, devices_per_host)], security=security)

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes attached now. ``pids`` holds the processes the
        cluster started: the controller, and each worker's keeper (pathways/keeper.py), whose
        child the worker is."""
        return [w["pid"] for w in status(self.address, security=self.security)["workers"]]

    def worker_command(self, island_id: int, worker_token_file: str, token_file: Optional[str] = None) -> list[str]:
        """The command that adds a host to island ``island_id`` of this running cluster, or
        replaces one it lost: the worker the cluster would start, attaching with the worker
        token held in ``worker_token_file`` (and the clients' token in ``token_file`` where
        the cluster has one; without it the command takes PATHWAYS_TOKEN)."""
        island = self.islands[island_id]
        tokens = ["--worker-token-file", worker_token_file] + (["--token-file", token_file] if token_file else [])
        beats = [] if self.heartbeat_timeout is None else ["--heartbeat-timeout", repr(self.heartbeat_timeout)]
        return _python_cmd("worker", "--controller", str(self.address), "--platform", "cpu",
                           "--devices", str(island.devices_per_host), "--launcher", "none",
                           "--island", str(island_id), "--island-hosts", str(island.hosts),
                           *sec.child_flags(self.security), *tokens, *beats, *self._quota_flags())

    def _quota_flags(self) -> list[str]:
        return [] if self.session_memory is None else ["--session-memory", str(self.session_memory)]

    @property
    def num_workers(self) -> int:
        return sum(i.hosts for i in self.islands)

    def start(self) -> "LocalCluster":
        self._thread = threading.Thread(target=trio.run, args=(self._supervise,),
                                        name="pathways-supervisor", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout + 10) or self._failure:
            reason = self._failure or f"not ready within {self.start_timeout:.0f} s"
            self.stop()
            raise ConnectError(f"the local cluster did not start: {reason}")
        return self

    def stop(self) -> None:
        """Stop every child process; returns once all are reaped."""
        self._stopping = True
        if self._token is not None:
            try:
                self._token.run_sync_soon(self._cancel_all)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=_CONTROLLER_GRACE_SECONDS + _GRACE_SECONDS + 20)

    def _cancel_all(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    # ---- the supervisor (trio thread) -----------------------------------------------

    async def _supervise(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        procs: list[_Forked] = []
        try:
            async with trio.open_nursery() as nursery:
                self._cancel = nursery.cancel_scope
                if self._stopping:
                    return
                with trio.fail_after(self.start_timeout):
                    env = sec.child_env(self.security, {**os.environ, config.PARENT_PID.name: str(os.getpid()),
                                                        **child_log_env()}, cluster_process=True)
                    secure = sec.child_flags(self.security)
                    beats = ([] if self.heartbeat_timeout is None
                             else ["--heartbeat-timeout", repr(self.heartbeat_timeout)])
                    ifrt = ([] if self.ifrt_port is None
                            else ["--ifrt-bind", f"{rpc.LOOPBACK}:{self.ifrt_port}"])
                    stuck = [] if self.run_timeout is None else ["--run-timeout", repr(self.run_timeout)]
                    recovery = ["--host-recovery", "restart" if self.restart_workers else "none"]
                    controller_cmd = _python_cmd("controller", "--policy", self.policy, "--window", str(self.window),
                                                 *sec.child_flags(self.security, data_plane=False), *beats, *stuck,
                                                 *recovery)
                    controller = await _start([*controller_cmd, *ifrt], env, None)
                    procs.append(controller)
                    address, ifrt_address = await _read_address(controller.stdout, bool(ifrt))
                    # a restarted controller binds the same ports: its workers and clients find it there
                    controller_cmd += ["--bind", address.removeprefix("grpc://")]
                    if ifrt_address:
                        controller_cmd += ["--ifrt-bind", ifrt_address.removeprefix("grpc://")]
                    options = ["--unsafe-local-order"] if self.unsafe_local_order else []
                    if self.suspend_dir:
                        options += ["--suspend-dir", self.suspend_dir]
                    if self.checkpoint_dir:
                        options += ["--checkpoint-dir", self.checkpoint_dir]
                    if self.colocated_python:
                        options += ["--colocated-python"]
                    options += self._quota_flags()
                    for island_id, island in enumerate(self.islands):
                        # island i is named "i" (so its id is i) and ranks follow start order,
                        # so that a cluster's layout is the same every time; CPU devices whatever
                        # accelerators the machine has, and places given here whatever launcher
                        # (srun, a Kubernetes Job) started this process
                        for rank in range(island.hosts):
                            # started as its keeper, which restarts it when it asks (keeper.py)
                            procs.append(await _start(
                                keeper.command(keeper.RECONNECT_TIMEOUT, _python_cmd(
                                    "worker", "--controller", address, "--platform", "cpu",
                                    "--devices", str(island.devices_per_host), "--launcher", "none",
                                    "--island", str(island_id), "--island-hosts", str(island.hosts),
                                    "--rank", str(rank), *options, *secure, *beats)),
                                env, _STDERR_FD))
                    self.pids = [p.pid for p in procs]
                    for i, p in enumerate(procs):
                        nursery.start_soon(self._watch, procs, i, "controller" if i == 0 else "worker",
                                           controller_cmd if i == 0 else p.args, env)
                    await trio.to_thread.run_sync(wait_for_workers, address, self.num_workers,
                                                  self.start_timeout, self.security, abandon_on_cancel=True)
                self.address, self.ifrt_address = address, ifrt_address
                self._ready.set()
                await trio.sleep_forever()
        except BaseException as e:  # noqa: B036 - reported to start(), then re-raised
            if not self._ready.is_set():
                self._failure = f"{type(e).__name__}: {e}"
            if not isinstance(e, trio.Cancelled):
                raise
        finally:
            self._ready.set()
            with trio.CancelScope(shield=True):
                # The controller first, so that workers going away are not reported as lost.
                await _reap(procs[:1], _CONTROLLER_GRACE_SECONDS)
                await _reap(procs[1:])

    async def _watch(self, procs: list[_Forked], i: int, role: str, command: list[str],
                     env: dict[str, str]) -> None:
        """Wait for ``procs[i]`` to exit; start ``command`` in its place when the cluster
        restarts that kind of process (with a back-off), else report it."""
        pause = RESTART_FIRST_PAUSE
        while True:
            proc = procs[i]
            started = time.monotonic()
            code = await proc.wait()
            if self._stopping:
                return
            log.log(logging.INFO if code == 0 else logging.ERROR,
                    "pathways process %d (%s) exited with code %s", proc.pid, role, code)
            if not self._ready.is_set():
                self._failure = f"process {role} exited with code {code} during start-up"
                self._ready.set()
                return
            if role == "worker" and code == 0:
                return  # the controller told it to exit (it was retired): it is not wanted back
            if not (self.restart_controller if role == "controller" else self.restart_workers):
                if role == "controller":
                    self.controller_code = code
                    self.controller_exited.set()
                return
            pause = RESTART_FIRST_PAUSE if time.monotonic() - started >= RESTART_STABLE_SECONDS else pause
            log.warning("restarting the %s in %g s (it exited with code %s)", role, pause, code)
            await trio.sleep(pause)
            pause = min(pause * 2, RESTART_MAX_PAUSE)
            if self._stopping:
                return
            replacement = await _start(command, env, None if role == "controller" else _STDERR_FD)
            procs[i] = replacement
            self.pids = [p.pid for p in procs]
            self.restarts += 1
            if role == "controller":
                try:
                    with trio.fail_after(self.start_timeout):
                        await _read_address(replacement.stdout)
                except (ConnectError, trio.TooSlowError) as e:
                    log.error("the restarted controller did not start: %s", e)
                    continue  # it exits, or is killed when the cluster stops; the loop restarts it
                log.warning("the controller restarted at %s; its workers attach to it again", self.address)


async def _read_address(stream: trio.abc.ReceiveStream, ifrt: bool = False) -> tuple[str, Optional[str]]:
    """The controller's address from its stdout, and (``ifrt``) its IFRT proxy server's."""
    wanted = [ADDRESS_LINE, IFRT_LINE] if ifrt else [ADDRESS_LINE]
    buf = b""
    found: dict[str, str] = {}
    while len(found) < len(wanted):
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise ConnectError(f"the controller exited before printing its address (got {buf!r})")
        buf += chunk
        *complete, _ = buf.decode(errors="replace").split("\n")  # the last part is an unfinished line
        for line in complete:
            word, _, rest = line.partition(" ")
            if word in wanted:
                found[word] = rest.strip()
    return found[ADDRESS_LINE], found.get(IFRT_LINE)


async def _reap(procs: list[_Forked], grace: float = _GRACE_SECONDS) -> None:
    alive = [p for p in procs if p.returncode is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace):
        for p in alive:
            await p.wait()
    for p in alive:
        if p.returncode is None:
            p.send_signal(signal.SIGKILL)
            await p.wait()


def stop_processes(procs: Sequence[subprocess.Popen], grace: float = _GRACE_SECONDS) -> None:
    """Stop and reap child processes: SIGTERM, then SIGKILL for those still running after
    ``grace`` seconds (processes running JAX may ignore SIGTERM)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_for_workers(address: str, count: int, timeout: float, security: Security | None = None) -> dict:
    """Poll the controller until ``count`` workers have registered; returns its status."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(address, timeout=max(1.0, deadline - time.monotonic()), security=security)
        if len(st["workers"]) >= count:
            return st
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"only {len(st['workers'])} of {count} workers registered "
                                        f"within {timeout:.0f} s")
        time.sleep(0.05)


# The functions below take ``security``: the token and CA to reach the cluster with; by
# default PATHWAYS_TOKEN and PATHWAYS_TLS_CA.

def status(address: str, timeout: float = 10.0, security: Security | None = None) -> dict:
    """The controller's view: workers, their devices and load, sessions, slices, arrays
    (protocol/messages.py ClusterStatus says what each field means)."""
    reply = _unary(address, rpc.CONTROLLER_SERVICE, "Status", timeout, security=security)
    return operator.answer(operator.STATUS_REPLY, reply).as_dict()


def worker_stats(address: str, timeout: float = 10.0, security: Security | None = None) -> dict:
    """One worker's object store and executable cache counts (protocol/operator.py
    WorkerStats says what each means)."""
    reply = _unary(address, rpc.WORKER_SERVICE, "Stats", timeout, security=security)
    return operator.answer(operator.STATS_REPLY, reply).as_dict()


def measure(address: str, timeout: float = 60.0, security: Security | None = None) -> dict:
    """Have every worker measure its FLOP/s, memory and links to the other workers again,
    wait for all of them (at most ``timeout`` seconds), and return the controller's status
    with the new figures (``status(...)["workers"][i]["flops"]``, ``["links"]``). Raises
    DeadlineExceededError naming the workers that did not report in time."""
    reply = _unary(address, rpc.CONTROLLER_SERVICE, "Measure", timeout + 10.0,
                   pack(MeasureRequest(timeout).encode()), security)
    return operator.answer(operator.STATUS_REPLY, reply).as_dict()


def retire(address: str, island: str = "", worker: Optional[int] = None, timeout: float = 60.0,
           security: Security | None = None) -> dict:
    """Retire island ``island`` (its name as ``status`` shows it) or, given ``worker``, that
    one host. It takes no new slices at once; the controller waits up to ``timeout`` seconds
    (0: not at all) for the runs queued and in flight there to finish, then tells its hosts
    to exit (their keepers do not start them again), fails what still involves them with
    WorkerLostError saying the operator retired them, releases its slices and forgets the
    island: its name is free for new workers. A lost island is simply forgotten. One host
    of a larger island is lost on purpose instead: the island heals once a host replaces it.

    Returns what was done: ``island``, ``id``, ``worker``, ``hosts`` (the worker ids shut
    down), ``runs_cut`` (runs still there when it was retired), ``slices_released``,
    ``sessions`` (those that had slices there), ``was`` (its state before: healthy, lost,
    healing, assembling; or forgotten, lost, when that happened while it drained) and
    ``drained``. Raises PathwaysError when there is no such island or worker, or it is
    being retired already."""
    if (worker is None) == (not island):
        raise ValueError("retire takes an island's name or a worker id, one of the two")
    try:
        reply = _unary(address, rpc.CONTROLLER_SERVICE, "Retire", timeout + 10.0,
                       pack(RetireRequest(island, worker, timeout).encode()), security)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        raise WireError(f"the controller at {address} does not serve retire: it runs an older pathways "
                        "version; install the same version on both") from None
    return operator.answer(operator.RETIRE_REPLY, reply, PathwaysError).as_dict()


def topology(address: str, measure_first: bool = False, timeout: float = 60.0,
             security: Security | None = None) -> Topology:
    """The cluster as a planner topology (pathways.planner.Topology): one device per
    worker, named by its worker id, with its measured FLOP/s and memory, and the measured
    links between workers. ``measure_first`` measures again before (see ``measure``);
    without it, a worker not measured yet raises the planner's PlanError."""
    from pathways.planner import Topology

    return Topology.from_status(measure(address, timeout, security) if measure_first
                                else status(address, timeout, security))


def measured_topology(address: str, timeout: float = 60.0, security: Security | None = None) -> Topology:
    """``topology``, measuring the workers first only when one of them has not been measured yet."""
    from pathways.planner import PlanError

    try:
        return topology(address, timeout=timeout, security=security)
    except PlanError:
        return topology(address, measure_first=True, timeout=timeout, security=security)


def _unary(address: str, service: str, name: str, timeout: float, request: bytes = b"",
           security: Security | None = None) -> bytes:
    """The reply payload of unary method ``name`` of the server at ``address``."""
    security = security or sec.for_client()
    channel = rpc.open_channel(address, security)
    try:
        rpc.wait_ready(channel, address, timeout, security=security)
        try:
            return rpc.method(channel, service, name, "unary_unary")(request, timeout=timeout)
        except grpc.RpcError as e:
            refused = rpc.refusal(e, address)
            if refused is None:
                raise
            raise refused from None
    finally:
        channel.close()

