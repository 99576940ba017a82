"""The worker process: the gRPC and socket shell around the worker's core (core.py).

It attaches to the controller with one long-lived stream, a TCP connection of frames
(wire/frames.py) to the port the controller's AttachAddress method names, at the host the
worker reached the controller at (registration and done reports up, op batches down; a
reader and a sender thread), serves clients' puts and fetches over gRPC, and hands the data
plane's frames from peers (wire/tcp.py) to the core; a client's put or fetch is served only
for its own session's arrays (core.py). In the background the core measures its FLOP/s and
its links to the other workers (measure.py).

Given a ``Security`` (wire/security.py), the worker gives the cluster's token on every
connection it opens (gRPC calls, the data plane; the worker token, where it has one, on
its stream to the controller) and requires it on every one it serves; its data listener
also requires a peer's ticket (peers.py). With TLS, its gRPC server and data listener
present its certificate and it verifies the controller's and its peers' with the CA.

Start-up runs in this order because ranks come from the controller: listen (gRPC, data
plane, and for an island of several hosts a reserved coordinator port; all on the bind
host, see island.py), attach and register with the advertised addresses, wait for the
welcome (this host's rank and its island's coordinator; or a refusal, which ends the
process with its reason), configure JAX and join the island's jax.distributed group, and
only then build the core; JAX and the core's modules are imported in the background from
the start, and a controller not listening yet is waited for (``--connect-timeout``). What the controller sends meanwhile is kept and handed to the
core in order; callers of the gRPC methods and the data plane wait for the core.

When the controller says the island lost a host, the worker has its keeper
(pathways/keeper.py) restart it, and joins the island again; when the controller's stream
ends, or the controller is judged lost (below), it is restarted to attach again once the
controller is back (``--reconnect-timeout``); when the controller says to stop, it exits.

Liveness (wire/liveness.py): a trio task on the main thread queues a heartbeat for the
controller whenever nothing else went out for a while, from the moment it attaches, and
watches the controller: once it has sent nothing (not even a heartbeat) for the heartbeat
timeout, it is judged by what the kernel knows of the connection (liveness.judge): a
controller whose host still acknowledges is slow (starved of CPU, or stopped) and is waited
for, a warning says so; one whose host stopped acknowledging (a cut cable, a dead host), or
on platforms whose kernel says nothing any silent one, is lost: the stream ends. The
stream's reader and sender threads therefore block without a timeout: the watch, or the
end of the connection, is what ends their waits.

Concurrency: trio on the main thread runs start-up, signals and the liveness watch, and
hands blocking steps (attaching, configuring JAX, building the core) to its worker threads.
Beside it, threads with one job each: the stream's reader and sender, the gRPC server's
pool (sessions.GRPC_THREADS), the data listener's accept thread and a thread per peer
connection (wire/tcp.py), and the core's own: one executor thread that runs op streams in
order and its done reporter, one compile thread, four data-plane senders, and the
measurement thread. What they share is kept under locks (core.py, store.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import math
import os
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import grpc
import trio

from pathways.defaults import CONTROLLER_STOPPED, HEARTBEAT_TIMEOUT
from pathways.errors import AccessDeniedError, ConnectError, PathwaysError, ResourceExhaustedError, WireError
from pathways.platforms import Devices
from pathways.protocol.messages import (COLOCATED, FETCH, LOAD, MAX_MESSAGE_BYTES, PROFILE, SAVE, TIMELINE,
                                        WORKER_DOWN, DataKey, Heartbeat, Message, Peers, Register, Reset, Shutdown,
                                        Table, WorkerWelcome)
from pathways.protocol import streams
from pathways.protocol import operator
from pathways.protocol.data import FetchReply, PutAnswer
from pathways.protocol.errors import REMOTE, WIRE, kind_of
from pathways.threads import Threads
from pathways.wire import codec, frames, rpc, tcp
from pathways.wire.addresses import PortReservation, join_host_port, split_host_port
from pathways.wire.liveness import Heartbeats, TcpState, Verdict, check_timeout, judge
from pathways.wire.security import Security, SecurityConfigError
from pathways.wire.tls_socket import SharedTlsSocket
from pathways import config, keeper
from pathways.worker import native_stdout
from pathways.worker.island import IslandMembership, configure_jax, leave_group, worker_hosts
from pathways.worker.peers import PeerTickets, frame_parties
from pathways.worker.sessions import GRPC_THREADS

if TYPE_CHECKING:  # imported when needed: the core takes JAX's devices, which exist after configure_jax
    from pathways.worker.core import WorkerCore

log = logging.getLogger("pathways.worker")

RESTART = "restart"  # the island lost a host: restart now and rejoin it
RECONNECT = "reconnect"  # the controller went away: restart and attach again once it is back

__all__ = ["IslandMembership", "WorkerService", "main"]


class WorkerService:
    """The worker's gRPC methods (Put, Fetch, Stats) over a core, which may come later
    (``attach``): until then a call waits for it, at most ``wait`` seconds."""

    def __init__(self, core: Optional["WorkerCore"] = None, wait: float = 30.0) -> None:
        self._core = core
        self._wait = wait
        self._ready = threading.Event()
        if core is not None:
            self._ready.set()

    def attach(self, core: "WorkerCore") -> None:
        self._core = core
        self._ready.set()

    def core(self) -> Optional["WorkerCore"]:
        """The core, once it exists (None if it did not within the wait)."""
        return self._core if self._ready.wait(self._wait) else None

    def put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """A client's array, answered with a PutAnswer (protocol/data.py): its error's kind
        is AccessDeniedError when the put was refused for its credential, and
        ResourceExhaustedError when it would take its session past its quota."""
        chunks = iter(request_iterator)
        return self._put(next(chunks, b""), chunks)

    def put_one(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A small array in one message, a msgpack list ``[header, chunk, ...]`` of what
        Put streams; answered as Put. Unary, so the client sends it without a thread of
        its own."""
        try:
            parts = codec.unpack(request)
        except WireError as e:
            return codec.pack(PutAnswer(str(e)).header())
        if type(parts) is not list or not parts or not all(type(p) is bytes for p in parts):
            return codec.pack(PutAnswer("a PutOne request must be a msgpack list of binaries [header, chunk, ...]; "
                                        "send larger arrays with Put").header())
        return self._put(parts[0], iter(parts[1:]))

    def _put(self, header: bytes, chunks: Iterator[bytes]) -> bytes:
        core = self.core()
        if core is None:
            return codec.pack(PutAnswer(_NOT_READY).header())
        try:
            error = core.client_put(codec.unpack(header), chunks)
        except WireError as e:
            return codec.pack(PutAnswer(str(e)).header())
        except (AccessDeniedError, ResourceExhaustedError) as e:
            return codec.pack(PutAnswer(str(e), type(e).__name__).header())
        return codec.pack(PutAnswer(error or None).header())

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = FETCH.decode_one(request)
        except WireError as e:
            yield codec.pack(FetchReply.error(WIRE, f"the worker refused a fetch: {e}").header())
            return
        core = self.core()
        if core is None:
            yield codec.pack(FetchReply.error(WIRE, _NOT_READY).header())
            return
        # A caller that hangs up (cancels, or runs past its deadline) wakes the waiter, which
        # then sees it is no longer wanted and gives its thread back.
        if not context.add_callback(core.store.wake):
            return  # the call already ended
        yield from core.fetch(req, context.is_active)

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The worker's counts (operator.WorkerStats), or Failed while it is not ready."""
        core = self.core()
        return operator.reply(core.stats() if core is not None else operator.Failed(_NOT_READY, WIRE))

    def timeline(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The spans of a session's traced runs (``messages.Timeline``), or Failed for a
        malformed request or a wrong credential."""
        try:
            req = TIMELINE.decode_one(request)
        except WireError as e:
            return operator.reply(operator.Failed(f"the worker refused a timeline request: {e}", WIRE))
        core = self.core()
        if core is None:
            return operator.reply(operator.Failed(_NOT_READY, WIRE))
        try:
            return operator.reply(core.timeline(req))
        except AccessDeniedError as e:
            return operator.reply(operator.Failed(str(e), AccessDeniedError.__name__))

    def save(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Write this host's blocks of a session's array into a checkpoint (SaveRequest),
        answered with Saved or Failed."""
        def call(core: "WorkerCore", req: Message) -> Message:
            _wake_on_hang_up(core, context)
            return core.save(req, context.is_active)
        return self._core_call(request, SAVE, "save", call)

    def load(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Make and store this host's blocks of a session's array from a checkpoint
        (LoadRequest), answered with Saved or Failed."""
        return self._core_call(request, LOAD, "load", lambda core, req: core.load(req))

    def colocated(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Run a session's colocated Python function on this host's shards of its arrays
        (ColocatedRequest), answered with ColocatedDone or Failed."""
        def call(core: "WorkerCore", req: Message) -> Message:
            _wake_on_hang_up(core, context)
            return core.run_colocated(req, context.is_active)
        return self._core_call(request, COLOCATED, "colocated Python call", call)

    def profile(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Start or stop a session's profile of this worker's process (ProfileRequest),
        answered with Profiled or Failed."""
        return self._core_call(request, PROFILE, "profile request", lambda core, req: core.profile(req))

    def _core_call(self, request: bytes, table: Table, what: str,
                         call: Callable[["WorkerCore", Message], Message]) -> bytes:
        core = self.core()
        if core is None:
            return operator.reply(operator.Failed(_NOT_READY, WIRE))
        try:
            req = table.decode_one(request)
        except WireError as e:
            return operator.reply(operator.Failed(f"the worker refused a {what}: {e}", WIRE))
        return _answered(lambda: call(core, req))

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Put": rpc.stream_unary(self.put), "PutOne": rpc.unary_unary(self.put_one),
                "Fetch": rpc.unary_stream(self.fetch),
                "Stats": rpc.unary_unary(self.stats), "Timeline": rpc.unary_unary(self.timeline),
                "Save": rpc.unary_unary(self.save), "Load": rpc.unary_unary(self.load),
                "Colocated": rpc.unary_unary(self.colocated), "Profile": rpc.unary_unary(self.profile)}


def _wake_on_hang_up(core: "WorkerCore", context: grpc.ServicerContext) -> None:
    """A caller that hangs up wakes the call's waits for arrays, which then give its thread
    back; WireError if it hung up already."""
    if not context.add_callback(core.store.wake):
        raise WireError("the caller hung up")


def _answered(call: Callable[[], Message]) -> bytes:
    """``call()``'s reply, or Failed with the error it raised: of its kind for pathways' own
    errors, any other (a disk's, a file's) as a remote error naming it."""
    try:
        return operator.reply(call())
    except PathwaysError as e:
        return operator.reply(operator.Failed(str(e), kind_of(e)))
    except Exception as e:  # a disk's error (OSError), a file numpy cannot read as an array
        return operator.reply(operator.Failed(f"{type(e).__name__}: {e}", REMOTE))


_NOT_READY = ("the worker is still joining its island (its other hosts have not all started); try again "
              "once `python -m pathways status` shows the island healthy")


class Joining:
    """The controller's stream before the core exists: keeps every payload, in order, and
    notes the welcome or the refusal among them, the controller's heartbeat timeout
    (``on_heartbeat``: joining may take minutes, and this worker must beat often enough for
    it all along), and this worker's data-plane key and tickets (``tickets``: peers measure
    their links to a newcomer at once); ``hand_to`` gives what was kept to the core and sends later payloads
    straight to it. Called from the reader thread."""

    def __init__(self, on_welcome: Callable[[], None], on_shutdown: Callable[[], None],
                 on_heartbeat: Callable[[float], None], tickets: PeerTickets) -> None:
        self._lock = threading.Lock()
        self._tickets = tickets
        self._kept: list[bytes] = []
        self._core: Optional["WorkerCore"] = None
        self._on_welcome = on_welcome
        self._on_shutdown = on_shutdown
        self._on_heartbeat = on_heartbeat
        self.welcome: Optional[WorkerWelcome] = None
        self.shutdown: Optional[str] = None  # the controller's reason, if it refused or stopped this worker
        self.reset: Optional[str] = None  # the controller's reason, if it told this worker to restart and rejoin

    def on_batch(self, payload: bytes) -> None:
        with self._lock:
            if self._core is not None:
                core = self._core
            else:
                self._kept.append(payload)
                self._note(payload)
                return
        core.on_batch(payload)

    def _note(self, payload: bytes) -> None:
        try:
            batch = WORKER_DOWN.decode_batch(payload)
        except WireError:
            return  # the core reports it once it exists
        for msg in batch:
            if type(msg) is WorkerWelcome and self.welcome is None:
                self.welcome = msg
                self._on_welcome()
            elif type(msg) is Shutdown and self.shutdown is None:
                self.shutdown = msg.reason
                self._on_shutdown()
            elif type(msg) is Reset and self.reset is None:
                self.reset = msg.reason
                self._on_shutdown()
            elif type(msg) is Heartbeat:
                self._on_heartbeat(msg.timeout)
            elif type(msg) is DataKey or type(msg) is Peers:
                self._tickets.learn(msg)  # peers may connect (to measure the link) while this worker joins

    def hand_to(self, core: "WorkerCore") -> None:
        with self._lock:
            for payload in self._kept:
                core.on_batch(payload)
            self._kept.clear()
            self._core = core


def main(controller: str, devices: Devices, island: IslandMembership, wait_timeout: float, connect_timeout: float,
         join_timeout: float = 300.0, bind: Optional[str] = None, advertise: Optional[str] = None,
         unsafe_local_order: bool = False, security: Security | None = None,
         heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
         reconnect_timeout: float = keeper.RECONNECT_TIMEOUT, suspend_dir: Optional[str] = None,
         compile_cache: Optional[str] = None, session_memory: Optional[int] = None,
         checkpoint_dir: Optional[str] = None, colocated_python: bool = False) -> None:
    """Serve until the controller stops it: attach to ``controller``, join ``island``
    (JAX serves ``devices``, and joins the island's jax.distributed group when it
    has several hosts, waiting up to ``join_timeout`` seconds for the other hosts). Servers
    listen on ``bind`` and are advertised at ``advertise`` (defaults: island.py
    ``worker_hosts``). A refusal by the controller exits with its reason. ``security``: the
    token and TLS of every connection (wire/security.py).

    Run by its keeper (pathways/keeper.py, which ``pathways worker`` starts), the worker
    asks to be restarted, with the keeper's exit codes, when its island lost a host, to join
    the island's next jax.distributed group, and when the controller goes away (its stream
    ends, or it stays silent for ``heartbeat_timeout`` seconds), to attach again once it is
    back: the new process tries for ``reconnect_timeout`` seconds, then exits. A new process
    because JAX cannot leave a jax.distributed group and join another in-process, and
    because a controller that restarted knows nothing of the old state. ``suspend_dir``:
    the directory under which a suspended session's files may be written (none: in host
    memory only). ``compile_cache``: the directory executables are kept in across processes
    (worker/compile_cache.py; none: each process compiles its own). ``session_memory``: the
    bytes of arrays each client session may hold on this worker (worker/quota.py; 0: no
    limit; None: three quarters of the host's memory). ``checkpoint_dir``: the directory
    under which clients' checkpoints may be written and read (worker/checkpoints.py; none:
    no checkpoints). ``colocated_python``: whether clients may run colocated Python
    functions here (worker/colocated.py: their code, in this process)."""
    native_stdout.filter_stdout(log)
    # A native crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) prints every thread's Python
    # stack on stderr, the cluster's log, before the process dies of it: where it happened.
    faulthandler.enable(all_threads=True)
    security = security or Security()
    if security.serves_tls != security.uses_tls:
        raise SecurityConfigError("a worker uses TLS with --tls-cert and --tls-key (clients and peers reach its "
                                  "servers over TLS) and --tls-ca (it verifies the controller's and its peers' "
                                  "certificates): give all three, or none")
    if not all(math.isfinite(t) and t > 0 for t in (wait_timeout, connect_timeout, join_timeout)):
        raise SystemExit(f"--wait-timeout, --connect-timeout and --join-timeout must be finite numbers of seconds "
                         f"above 0, got {wait_timeout!r}, {connect_timeout!r} and {join_timeout!r}")
    try:
        check_timeout(heartbeat_timeout)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        controller_host, controller_port = split_host_port(rpc.parse_address(controller))
        bind_host, advertise_host = worker_hosts(controller_host, controller_port, bind, advertise)
    except (ConnectError, ValueError) as e:
        raise SystemExit(f"error: --controller: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: no route to the controller at {controller} ({e}); check the address, or pass "
                         "--advertise HOST (the address other hosts reach this one at)") from None
    if not (math.isfinite(reconnect_timeout) and reconnect_timeout >= 0):
        raise SystemExit(f"--reconnect-timeout must be a finite number of seconds, 0 or more, got {reconnect_timeout!r}")
    # one import, once per process: it ends on its own, and nothing waits for it
    threading.Thread(target=_import_core, name="pathways-import", daemon=True).start()
    reconnecting = os.environ.pop(config.RECONNECT_UNTIL.name, None)
    if reconnecting is not None:
        error = _wait_for_controller(controller, reconnecting, security)
        if error:
            raise SystemExit(f"error: {error}")
    error, again = trio.run(_serve, _Options(controller, devices, island, bind_host, advertise_host, wait_timeout,
                                             connect_timeout, join_timeout, unsafe_local_order, security,
                                             heartbeat_timeout, suspend_dir, compile_cache, session_memory,
                                             checkpoint_dir, colocated_python))
    _exit(controller, island, reconnect_timeout, error, again)


def _exit(controller: str, island: IslandMembership, reconnect_timeout: float, error: Optional[str],
          again: Optional[str]) -> None:
    """End the worker process as ``_serve``'s outcome says: with the keeper's exit code that
    asks for a restart (RESTART, RECONNECT), with the error, or normally."""
    kept = bool(config.WORKER_KEPT.get())
    code = 1 if error else 0
    if again == RECONNECT and reconnect_timeout > 0 and kept:
        log.warning("the controller at %s went away; this worker restarts and attaches again once it is back "
                    "(for up to %g s, --reconnect-timeout)", controller, reconnect_timeout)
        error, code = None, keeper.RECONNECT
    elif again == RESTART and kept:
        log.info("restarting to join island %r again", island.name)
        error, code = None, keeper.RESTART
    elif again is not None:
        error = error or (f"the controller at {controller} went away" if again == RECONNECT else
                          f"island {island.name!r} lost a host") + "; this worker is not run by its keeper, so it exits"
        code = 1
    if island.hosts > 1:
        # jax.distributed's exit handler waits at a barrier for every host of the island,
        # which never comes when one of them is lost.
        if error:
            print(f"error: {error}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(code)
    if error:
        raise SystemExit(f"error: {error}")
    if code:
        logging.shutdown()
        sys.exit(code)


def _import_core() -> None:
    """Import JAX and the worker's core (a second or more of CPU) while the worker attaches
    and waits for its welcome, instead of after: importing them sets nothing up (JAX's
    backends start when configure_jax has run and the core is built)."""
    try:
        import pathways.worker.core  # noqa: F401
    except Exception:  # _start_core imports it again, and there its error ends the worker
        pass


def _wait_for_controller(controller: str, until: str, security: Security) -> Optional[str]:
    """In a worker that restarted because its controller went away: wait until the
    controller at ``controller`` answers again, until wall-clock time ``until``
    (config.RECONNECT_UNTIL); returns why not, or None. The channel tries again every
    second at most (rpc.MAX_RECONNECT_BACKOFF_MS), so the worker attaches within about a
    second of the controller's return."""
    try:
        deadline = float(until)
    except ValueError:
        return f"{config.RECONNECT_UNTIL.name}={until!r} is not a time; unset it"
    left = max(0.1, deadline - time.time())
    channel = rpc.open_channel(controller, security)
    try:
        rpc.wait_ready(channel, controller, left, refused_grace=left, security=security)
    except ConnectError as e:
        return f"the controller at {controller} did not come back within the reconnect timeout (--reconnect-timeout): {e}"
    finally:
        channel.close()
    log.info("the controller at %s answers again; attaching", controller)
    return None


def _attach(channel: grpc.Channel, controller: str, timeout: float, security: Security) -> socket.socket:
    """Ask the controller at ``controller`` (grpc://HOST:PORT) which port workers attach
    to, and connect to that port of HOST (over TLS when the controller uses it, greeted
    with the worker token), within ``timeout`` seconds each."""
    ask = rpc.method(channel, rpc.CONTROLLER_SERVICE, "AttachAddress", "unary_unary")
    try:
        port = operator.answer(operator.ATTACH_REPLY, ask(b"", timeout=timeout)).port
        host, _ = split_host_port(rpc.parse_address(controller))
        sock = tcp.connect(f"tcp://{join_host_port(host, port)}", timeout, security.for_attach(), tls=security.uses_tls)
    except grpc.RpcError as e:
        raise rpc.refusal(e, controller) or ConnectError(
            f"could not ask the controller at {controller} where to attach ({e.code().name}); check that it is "
            "running (`python -m pathways status` asks it)") from None
    except (OSError, WireError, ValueError) as e:
        raise ConnectError(f"could not attach to the controller at {controller} ({type(e).__name__}: {e}); "
                           "check that it is running and that it is a pathways controller of this version "
                           "(`python -m pathways status` asks it)") from None
    return sock


async def _first(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(wait)


@dataclass(frozen=True)
class _Options:
    """How ``main`` runs the worker (its doc says what each is); ``bind`` and ``advertise``
    resolved."""

    controller: str
    devices: Devices
    island: IslandMembership
    bind: str
    advertise: str
    wait_timeout: float
    connect_timeout: float
    join_timeout: float
    unsafe_local_order: bool
    security: Security
    heartbeat_timeout: float
    suspend_dir: Optional[str]
    compile_cache: Optional[str]
    session_memory: Optional[int]
    checkpoint_dir: Optional[str]
    colocated_python: bool


async def _serve(options: _Options) -> tuple[Optional[str], Optional[str]]:
    """Run the worker until its controller or a signal stops it; returns why it could not
    run (or None), and whether to restart: RESTART (the controller said so: the island
    lost a host), RECONNECT (the controller went away), or None (stop)."""
    serving = _Serving(options, trio.lowlevel.current_trio_token())
    try:
        return await serving.run()
    except ConnectError as e:
        return str(e), None
    finally:
        serving.close()


class _Serving:
    """One run of the worker process (``_serve``): its servers, its stream to the
    controller, and its core once the controller has welcomed it; ``close`` releases them
    all, whatever state the run ended in."""

    def __init__(self, options: _Options, token: trio.lowlevel.TrioToken) -> None:
        self.options, self._token = options, token
        self.ended, self.welcomed = trio.Event(), trio.Event()
        self.end = self._setter(self.ended)
        self.settled = threading.Event()  # the stream's end is expected from now on (see _start_stream)
        self.beats = Heartbeats(options.heartbeat_timeout)
        self.tickets = PeerTickets()
        self.joining = Joining(self._setter(self.welcomed), self.end, self.beats.learn, self.tickets)
        self.service = WorkerService(wait=options.join_timeout)
        self.outbox = streams.Outbox()
        self.channel = rpc.open_channel(options.controller, options.security)
        self.listener: Optional[tcp.Listener] = None
        self.server: Optional[grpc.Server] = None
        self.reservation: Optional[PortReservation] = None
        self.sock: Optional[socket.socket] = None
        self.close_stream: Callable[[], None] = lambda: None  # called before sock is shut down
        self.stream_threads = Threads("the worker's controller stream")  # its sender and reader
        self.core: Optional["WorkerCore"] = None
        self.told: list[str] = []  # what the controller told the running core: "shutdown" or "reset"

    def _setter(self, event: trio.Event) -> Callable[[], None]:
        def set_soon() -> None:  # from any thread
            try:
                self._token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass
        return set_soon

    def _receive_frame(self, header: dict, pieces: list) -> Optional[str]:
        core = self.service.core()
        return core.receive_frame(header, pieces) if core is not None else _NOT_READY

    def _screen_frame(self, sender: int, header: dict) -> Optional[str]:
        core = self.service.core()
        return core.screen_frame(sender, header) if core is not None else _NOT_READY

    async def run(self) -> tuple[Optional[str], Optional[str]]:
        o = self.options
        try:
            # Data-plane peers get the heartbeat timeout too: a frozen peer must not hold a send or
            # a half-received frame for longer than the controller takes to declare it lost.
            self.listener = tcp.Listener(self._receive_frame, o.heartbeat_timeout, host=o.bind,
                                         security=o.security, admit=self.tickets.admit, screen=self._screen_frame,
                                         parties=frame_parties)
            self.server, port = rpc.make_server(rpc.WORKER_SERVICE, self.service.handlers(), host=o.bind,
                                                security=o.security, max_workers=GRPC_THREADS)
            self.reservation = PortReservation(o.bind) if o.island.hosts > 1 else None
        except (ConnectError, OSError, SecurityConfigError) as e:
            return (f"the worker cannot listen on {o.bind} ({e}); pass --bind an address of this machine "
                    "(or 0.0.0.0 with --advertise HOST)"), None
        await self._attach(port)
        error, signalled = await self._until_stopped()
        if signalled:
            return None, None
        if self.joining.reset is not None or "reset" in self.told:
            return None, RESTART
        if self.joining.shutdown == CONTROLLER_STOPPED:
            return None, None  # stopped on purpose while this worker was joining: no error
        if self.joining.shutdown is not None or "shutdown" in self.told or (error and not self.ended.is_set()):
            return error, None
        return error, RECONNECT  # the controller's stream ended, or it went silent

    async def _attach(self, port: int) -> None:
        """Attach to the controller (which may start after this worker: a refused connection
        is tried again), register, and start the stream's threads."""
        o, listener = self.options, self.listener
        assert listener is not None
        coordinator = join_host_port(o.advertise, self.reservation.port) if self.reservation is not None else ""
        await trio.to_thread.run_sync(functools.partial(rpc.wait_ready, self.channel, o.controller, o.connect_timeout,
                                                        refused_grace=o.connect_timeout, security=o.security))
        sock = self.sock = await trio.to_thread.run_sync(_attach, self.channel, o.controller, o.connect_timeout,
                                                         o.security)
        self.outbox.put(Register(f"grpc://{join_host_port(o.advertise, port)}",
                                 f"tcp://{join_host_port(o.advertise, listener.port)}", o.devices.kind,
                                 o.devices.count, o.island.name, o.island.hosts, o.island.rank, coordinator,
                                 os.getpid(), socket.gethostname(), codec.host_memory_bytes(),
                                 o.security.data_plane_tls))
        self.outbox.put(Heartbeat(o.heartbeat_timeout))  # at once: the controller paces its heartbeats to it
        # The stream's threads wait for the controller as long as it takes: _beat judges a silent
        # controller (slow or lost) and ends the stream once it is lost. Nor may the kernel end it
        # first: tcp.connect set TCP_USER_TIMEOUT, which also ends a connection whose peer's host
        # answers but whose process reads nothing for that long (measured on Linux 6.18), i.e. a
        # slow controller.
        sock.settimeout(None)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)
        self.close_stream = _start_stream(sock, self.outbox, self.joining.on_batch, self.end, self.beats,
                                          self.settled, self.stream_threads)

    def _told_to(self, what: str) -> Callable[[], None]:
        def note() -> None:
            self.told.append(what)
            self.settled.set()
            self.end()
        return note

    async def _run_core(self) -> Optional[str]:
        """Join the island, then run the core until the stream ends; why it could not, or None."""
        o = self.options
        error = await _join(o.island, o.devices, o.bind, o.advertise, o.join_timeout, self.joining, self.welcomed,
                            self.ended, self.reservation)
        if error:
            return error
        self.core = await _start_core(o.devices, o.island, o.wait_timeout, o.unsafe_local_order, self.outbox,
                                      self._told_to("shutdown"), self._told_to("reset"), self.ended, o.security,
                                      o.heartbeat_timeout, self.beats.learn, o.suspend_dir, self.tickets,
                                      o.compile_cache, o.session_memory, o.checkpoint_dir, o.colocated_python)
        if self.core is None:
            return _stopped(self.joining, o.island)
        self.joining.hand_to(self.core)  # the welcome first: it says which peers' copies are stale
        self.service.attach(self.core)
        await self.ended.wait()
        return None

    async def _until_stopped(self) -> tuple[Optional[str], bool]:
        """Run the core beside the heartbeats until it ends or a stop signal comes; why it
        could not run (or None), and whether a signal stopped it."""
        o, sock = self.options, self.sock
        error: Optional[str] = None
        signalled = False
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def stop_on_signal() -> None:
                    nonlocal signalled
                    async for _ in signals:
                        signalled = True
                        nursery.cancel_scope.cancel()
                nursery.start_soon(stop_on_signal)
                nursery.start_soon(_beat, self.beats, self.outbox, o.heartbeat_timeout, lambda: tcp.tcp_state(sock),
                                   self.end, o.controller)
                error = await self._run_core()
                nursery.cancel_scope.cancel()
            if o.island.hosts > 1 and self.joining.reset is None and "reset" not in self.told:
                # Stopping, and before this host's own teardown (which may take a while under
                # load), with stop signals still held by trio. Not after the island lost a
                # host, which would never leave: the group restarts without it.
                leave_group()
        return error, signalled

    def close(self) -> None:
        self.settled.set()
        self.outbox.close()
        self.close_stream()
        if self.sock is not None:
            with contextlib.suppress(OSError):  # the controller may have closed it already
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
            self.sock.close()
        self.stream_threads.join()
        if self.reservation is not None:
            self.reservation.close()
        if self.listener is not None:
            self.listener.close()
        if self.core is not None:
            self.core.close()
        if self.server is not None:
            self.server.stop(grace=0.5)
        self.channel.close()


async def _beat(beats: Heartbeats, outbox: streams.Outbox, timeout: float, tcp_state: Callable[[], Optional[TcpState]],
                end: Callable[[], None], controller: str) -> None:
    """Queue a heartbeat for the controller whenever nothing else went out for an interval,
    and judge the controller once it has been silent for the heartbeat timeout
    (liveness.judge, with ``tcp_state()``): slow, it is waited for and judged again each
    interval; lost, the stream ends (``end``) and so does this task."""
    silent_since: Optional[float] = None  # the controller's silence, as last judged slow
    while True:
        await trio.sleep(beats.until_beat() if silent_since is not None
                         else min(beats.until_beat(), beats.until_silent()))
        verdict = judge(beats, tcp_state()) if beats.silent_for() is not None else Verdict.ANSWERING
        silent = beats.silent_for()
        if verdict is Verdict.LOST:
            log.error("the controller at %s sent nothing for %.1f s (the heartbeat timeout is %g s), and its host "
                      "stopped acknowledging (or this platform cannot tell): it is unreachable or gone",
                      controller, silent, beats.timeout)
            end()
            return
        if verdict is Verdict.SLOW and silent_since is None:
            log.warning("the controller at %s sent nothing for %.1f s (the heartbeat timeout is %g s), but its host "
                        "still acknowledges: it is slow (starved of CPU, or stopped), and this worker waits for it",
                        controller, silent, beats.timeout)
        elif verdict is Verdict.ANSWERING and silent_since is not None:
            log.info("the controller at %s answers again after more than %.1f s of silence", controller,
                     silent_since)
        silent_since = silent if verdict is Verdict.SLOW else None
        if beats.beat_due():
            outbox.put(Heartbeat(timeout))
            beats.sent()  # queued is as good as sent; the sender's own sends count too


def _start_stream(sock: socket.socket, outbox: streams.Outbox, on_batch: Callable[[bytes], None],
                  end: Callable[[], None], beats: Heartbeats, settled: threading.Event,
                  threads: Threads) -> Callable[[], None]:
    """Threads (of ``threads``) that send ``outbox``'s batches on ``sock`` and hand what arrives to
    ``on_batch`` (each payload a sign of life for ``beats``); ``end`` is called when the
    stream ends either way (``sock`` blocks without a timeout: _beat ends a stream whose
    controller it judged lost, and the caller then shuts ``sock`` down). Once
    ``settled`` is set (the worker was told to stop or restart, or is closing), the
    stream's end is expected. Over TLS, the two threads take turns on the socket
    (``SharedTlsSocket``): OpenSSL's connection must not be used by both at once. Returns
    what to call before shutting ``sock`` down."""
    shared = SharedTlsSocket(sock, sock.gettimeout()) if isinstance(sock, ssl.SSLSocket) else None
    reader = frames.FrameReader(sock if shared is None else shared)
    sendall = sock.sendall if shared is None else shared.sendall

    def send() -> None:
        try:
            for payload in outbox.batches():
                sendall(frames.frame(payload))
                beats.sent()
        except OSError as e:
            # at info: a send also fails when the controller ends the stream on purpose, before
            # the reader has handed over its last message (a shutdown, say)
            log.info("controller stream ended while sending: %s", e)
            end()

    def read() -> None:
        try:
            # The controller is this worker's one trusted peer: no deadline within a frame or
            # between frames; _beat judges its silence and ends the stream once it is lost.
            while (payload := reader.read(MAX_MESSAGE_BYTES)) is not None:
                beats.heard()
                on_batch(payload)
            log.info("controller stream ended")
        except Exception as e:  # OSError or WireError, or ValueError once shutdown closed the reader
            # a connection cut while this worker still runs is worth a warning: it costs the island
            log.log(logging.INFO if settled.is_set() else logging.WARNING, "controller stream ended: %s: %s",
                    type(e).__name__, e)
        finally:
            end()

    threads.start(send, "pathways-attach-send")
    threads.start(read, "pathways-attach")
    return (lambda: None) if shared is None else shared.close


def _stopped(joining: Joining, island: IslandMembership) -> str:
    """Why the worker stopped before its core ran."""
    if joining.shutdown is not None:  # a refused registration, or its controller stopped
        return f"the controller shut this worker down: {joining.shutdown}"
    return f"the controller's stream ended while this worker was joining island {island.name!r}"


async def _join(island: IslandMembership, devices: Devices, bind: str, advertise: str, timeout: float,
                joining: Joining, welcomed: trio.Event, ended: trio.Event,
                reservation: Optional[PortReservation]) -> Optional[str]:
    """Wait for the welcome (this host's rank, the island's coordinator), then configure
    JAX and join the island's jax.distributed group, each within ``timeout`` seconds.
    Returns why that failed, or None."""
    with trio.move_on_after(timeout):
        await _first(welcomed, ended)
    if ended.is_set():
        return _stopped(joining, island)
    welcome = joining.welcome
    if welcome is None:
        return (f"island {island.name!r} has no rank 0 host yet, and this worker waited {timeout:g} s for it "
                "(--join-timeout); start every host of the island")
    if reservation is not None and welcome.rank != 0:
        reservation.close()  # the coordinator is another host's
    log.info("worker %d: rank %d of island %r (id %d) of %d host(s)", welcome.worker, welcome.rank, island.name,
             welcome.island, island.hosts)
    done = trio.Event()
    failure: list[BaseException] = []

    def configure() -> None:
        try:
            configure_jax(devices, island.hosts, welcome, bind, advertise, timeout)
        except Exception as e:  # jax's timeout and connection errors
            failure.append(e)

    async def run() -> None:
        await trio.to_thread.run_sync(configure, abandon_on_cancel=True)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await _first(done, ended)
        nursery.cancel_scope.cancel()  # a thread stuck in jax is abandoned: the process exits
    if not done.is_set():
        return _stopped(joining, island)
    if reservation is not None:
        reservation.close()  # the coordination service runs (rank 0) or the port was not needed
    if failure:
        return (f"joining island {island.name!r} as rank {welcome.rank} of {island.hosts} failed: {failure[0]}. "
                f"Its coordinator is {welcome.coordinator} (rank 0's advertised host): every host of the island "
                "must reach it and start within --join-timeout")
    return None


async def _start_core(devices: Devices, island: IslandMembership, wait_timeout: float, unsafe_local_order: bool,
                      outbox: streams.Outbox, on_shutdown: Callable[[], None], on_reset: Callable[[], None],
                      ended: trio.Event, security: Security, heartbeat_timeout: float,
                      on_heartbeat: Callable[[float], None], suspend_dir: Optional[str],
                      tickets: PeerTickets, compile_cache: Optional[str],
                      session_memory: Optional[int] = None, checkpoint_dir: Optional[str] = None,
                      colocated_python: bool = False) -> Optional["WorkerCore"]:
    """The worker's core (JAX's devices exist now); None if the stream ended first."""
    from pathways.worker.core import WorkerCore
    from pathways.worker.executor import collectives_bound

    in_flight = collectives_bound(devices.kind, devices.count, island.hosts)
    made: list["WorkerCore"] = []
    done = trio.Event()

    async def build() -> None:
        made.append(await trio.to_thread.run_sync(
            lambda: WorkerCore(outbox.put, wait_timeout, in_flight, unsafe_local_order, on_shutdown, security,
                               peer_timeout=heartbeat_timeout, on_heartbeat=on_heartbeat, on_reset=on_reset,
                               suspend_dir=suspend_dir, tickets=tickets, compile_cache=compile_cache,
                               session_memory=session_memory, checkpoint_dir=checkpoint_dir,
                               colocated_python=colocated_python),
            abandon_on_cancel=True))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(build)
        await _first(done, ended)
        nursery.cancel_scope.cancel()
    return made[0] if made else None
