"""A client session: one long-lived stream to the controller, and the data plane to workers.

Submissions are fire and forget: the client numbers every handle itself, so nothing waits
for the controller except placement and cluster queries. Deletes from dropped arrays are
batched and ride along with the next message (or a periodic flush).

``suspend()`` takes the session's arrays off the devices and releases its slices;
``resume()`` places them again (the controller says where with SliceMoved, and every
slice, array and function follows). In between, runs, puts and reads of its arrays
raise SuspendedError.

Its puts (puts.py) and fetches (fetches.py) are base classes of Session in modules of
their own, working on its state.

Nothing waits on a dead or silent peer: gRPC keepalive (wire/rpc.py) ends the session
stream within seconds of the controller dying or freezing, which fails every pending
request and fetch with ControllerLostError; a fetch blocked at a worker is cancelled as
soon as the controller reports its array poisoned (a lost worker). One blocked at a worker
that stopped answering (keepalive ends the call) waits for the controller's verdict, and
without one asks again: the controller, which judges hosts (wire/liveness.py), keeps a slow
worker (starved, busy or stopped), whose array is still to come, within the caller's wait.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import grpc

from pathways import errors
from pathways.client.checkpoints import Checkpoints
from pathways.client.colocated import Colocating
from pathways.client.profiles import Profiles
from pathways.client.computed import Computations
from pathways.client.fetches import Fetches
from pathways.client.puts import Puts
from pathways.client.timeline import RecordingBlock, Recordings, process_recording
from pathways.protocol import messages as m
from pathways.protocol import streams
from pathways.protocol.errors import error_of, kind_of
from pathways.protocol.handles import COUNTER_MASK, first_handle
from pathways.threads import Threads
from pathways.timeline import Recorder, now
from pathways.wire import rpc, tcp
from pathways.wire.counters import ByteCounter
from pathways.wire.security import Security

log = logging.getLogger("pathways.client")

DEFAULT_TIMEOUT = 300.0
# The library's advice; `pathways demo`, whose user writes no pw.connect() call, words it its own way.
EMBEDDED_ADVICE = "or call pw.connect() with no address (and PATHWAYS_ADDRESS unset) to start an embedded one"
_CONNECT_ADVICE = f"{rpc.START_ADVICE}, {EMBEDDED_ADVICE}"
_CLOSED = "this session is closed; call pw.connect() for a new one"  # what any use of a closed session raises


class WorkerStubs(NamedTuple):
    """The calls this session makes to one worker, over one channel."""

    put: Any  # Put, stream-unary: an array's pieces in chunks
    fetch: Any  # Fetch, unary-stream
    channel: grpc.Channel
    put_one: Any  # PutOne, unary-unary: a small array in one message
    credential: bytes  # what the session presents to this worker (messages.worker_credential)
    save: Any  # Save, unary-unary: write its blocks of an array into a checkpoint
    load: Any  # Load, unary-unary: make its blocks of an array from a checkpoint
    colocated: Any  # Colocated, unary-unary: run a colocated Python function on its shards
    profile: Any  # Profile, unary-unary: start or stop its profiler


class Session(Puts, Fetches, Checkpoints, Colocating, Profiles):
    """``connect_timeout``: seconds to wait for the controller to answer and greet the
    session (``result_timeout`` is another: how long a put or a wait for an array may take
    by default). ``security``: the token and CA this session reaches the controller and the
    workers with (none by default). ``open_local``: for a session opened in the controller's
    own process (the IFRT front end's), what opens its stream there without gRPC
    (ControllerServer.open_local); the workers are reached over the network all the same.
    ``data_plane``: there too, the connections to the workers' data listeners that
    ``put_chunks`` sends arrays on (a client process has none: it puts with gRPC)."""

    def __init__(self, address: str, connect_timeout: float = 30.0, owned_cluster: Any = None, weight: float = 1.0,
                 security: Security | None = None,
                 open_local: Optional[Callable[[streams.Outbox], Any]] = None,
                 data_plane: Optional[tcp.Pool] = None, array_bytes: Optional[ByteCounter] = None) -> None:
        if not 0 < weight <= 1e6:
            raise ValueError(f"a session's weight must be in (0, 1e6], got {weight!r}")
        self.address = address
        self.result_timeout = DEFAULT_TIMEOUT  # how long a put, or a wait for an array, may take by default
        self.security = security or Security()
        self._data_plane = data_plane
        # the bytes of array values this session sent to workers (puts) and received from
        # them (reads, and small outputs that came with a run's news); shared by the IFRT
        # front end's sessions
        self.array_bytes = array_bytes if array_bytes is not None else ByteCounter()
        self.poisoned: dict[int, tuple[type[errors.PathwaysError], str]] = {}
        self._owned_cluster = owned_cluster
        # a local cluster this process started (the embedded one, or pw.local_cluster's):
        # errors may then advise starting it differently
        self.local = owned_cluster is not None
        # timelines (client/timeline.py): while ``traced``, runs are marked traced and the
        # client's own steps go to ``recorder``
        self.traced = False
        self.recorder = Recorder()
        self.timeline_label = "client"  # this process's rows: its kind first (timeline_view groups by it)
        self.recordings = Recordings(self)
        self._process_recording = None  # PATHWAYS_TRACE's, once the controller has welcomed this session
        self._channel: Optional[grpc.Channel] = None
        if open_local is None:
            self._channel = rpc.open_channel(address, self.security)
            try:
                rpc.wait_ready(self._channel, address, connect_timeout, advice=_CONNECT_ADVICE, security=self.security)
            except BaseException:
                self._channel.close()
                raise
        self._outbox = streams.Outbox(releases=lambda handles: m.Delete(tuple(handles)))
        self._pending: dict[Any, Future] = {}
        self._req_ids = itertools.count(1)
        self._dead: Optional[str] = None
        self._dead_error: type[errors.ConnectError] = errors.ConnectError
        self._workers: dict[str, WorkerStubs] = {}
        self.moves = 0  # SliceMoved messages applied (PutNotice.moves)
        # the client Slice objects by id, so that SliceMoved updates them in place
        self.slices: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._fetches: dict[int, set] = {}  # handle -> its fetch calls in flight, cancelled on bad news
        self.computations = Computations()  # outputs of runs sent with notify: computed yet? (submit)
        self._fetches_lock = threading.Lock()
        # puts on their way to the workers, and puts still starting theirs: suspend waits for both
        self._puts: set[grpc.Future | Future] = set()
        self._starting_puts = 0
        self._puts_lock = threading.Condition()
        self.suspended = False  # from suspend() until resume() returns
        self._closed = threading.Event()
        self._threads = Threads("a client session")  # its reader, and its puts streamed on the data plane
        self._welcome: Future = Future()
        self._pending["welcome"] = self._welcome
        if open_local is not None:  # the controller's loop takes the outbox's batches itself
            self._responses = open_local(self._outbox)
        else:
            stream = rpc.method(self._channel, rpc.CONTROLLER_SERVICE, "Session", "stream_stream")
            self._responses = stream(self._outbox.batches())
        self._threads.start(self._read, "pathways-session")
        self._counter = itertools.count(1)
        self._counter_lock = threading.Lock()
        self._outbox.put(m.Hello(m.PROTOCOL_VERSION, weight))
        try:
            welcome = self._result(self._welcome, connect_timeout, "greet the client")
        except BaseException:
            self.close()
            raise
        self.id: int = welcome.session
        # what workers ask of every put and fetch of this session's arrays: never shown
        self._credential: bytes = welcome.credential
        self._process_recording = process_recording()
        if self._process_recording is not None:
            self.recordings.start(self._process_recording)

    def trace(self, path: str) -> RecordingBlock:
        """``with session.trace("run.json"):`` records every run this session submits in
        the block, on every process it touches, into a timeline file (``pw.trace``)."""
        return RecordingBlock(self.recordings, path)

    # ---- control plane ---------------------------------------------------------------

    def allocate(self, n: int) -> int:
        """The first of ``n`` consecutive fresh handles (also used for function/program ids)."""
        with self._counter_lock:
            start = next(self._counter)
            for _ in range(n - 1):
                next(self._counter)
        if start + n > COUNTER_MASK:
            raise errors.PathwaysError("this session has used up its handles; open a new session")
        return first_handle(self.id) + start

    def send(self, msg: m.Message) -> None:
        self._check_alive()
        self._outbox.put(msg)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block, the messages this session sends (from any thread) and the
        handles it releases are kept, to go to the controller as one batch when the block
        ends: the controller and the workers handle a batch of runs for about the cost of
        one. Whoever waits on the controller or a worker meanwhile (``request``, ``fetch``)
        sends what is kept first, so that nothing waits on a kept message."""
        self._outbox.hold()
        try:
            yield
        finally:
            self._outbox.unhold()

    def send_held(self) -> None:
        """Send what ``holding`` kept so far now, the block going on: for whoever is about to
        wait on something that may need it."""
        self._outbox.send_held()

    def submit(self, program: int, base: int, args: dict[int, int], what: str, notify: Sequence[int] = ()) -> None:
        """Send a run of ``program`` whose values start at handle ``base``, with ``args``
        (graph value -> handle) bound. While a recording is open the run is traced and its
        submission recorded, ``what`` naming it on the timeline. ``notify``: its outputs'
        handles, which ``computations`` then tells about once the run is finished."""
        traced = self.traced
        if traced:
            began = now()
        self.send(m.Run(program, base, args, traced, bool(notify) and self.computations.expect(notify)))
        if traced:
            self.recorder.span("submit", began, base, what)

    def wait_computed(self, handles: Sequence[int], timeout: float) -> Optional[bool]:
        """``computations.wait`` (client/computed.py), after sending what ``holding`` kept:
        the run computing them may be among it."""
        self._outbox.send_held()
        return self.computations.wait(handles, timeout)

    def define_xla(self, slice_id: int, name: str, artifact: bytes, options: bytes,
                   devices: tuple[tuple[int, int], ...]) -> tuple[int, Future]:
        """Have the workers of slice ``slice_id`` compile StableHLO portable artifact
        ``artifact`` with ``options`` (a serialized xla CompileOptionsProto) on ``devices``
        ((host rank, device index) pairs of the slice; logical device i of the executable
        is ``devices[i]``). Returns the new function's id and a future of its
        ``messages.Compiled`` (where its parameters and outputs live, their shardings,
        ...); the future raises RemoteError with a worker's compile error, the controller's
        refusal of the definition (WireError, PlacementError; WorkerLostError where the slice
        lost a host), or ControllerLostError.
        Programs may call the function once the future is done."""
        fn = self.allocate(1)
        future: Future = Future()
        self._pending[("compiled", fn)] = future
        try:
            self.send(m.DefineFunction(fn, slice_id, m.FunctionBody(name, artifact, (), (), "xla", options,
                                                                    m.flat_devices(devices))))
        except BaseException:
            self._pending.pop(("compiled", fn), None)
            raise
        return fn, future

    def suspend(self, path: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Suspend the session: admit no more of its runs and puts, wait (up to ``timeout``
        seconds) for those in flight, move every one of its arrays off the devices, into the host
        memory of the workers that hold them or, with ``path`` (an absolute directory on
        the workers' hosts), into files that each worker writes there for its own shards;
        then release its slices. Until ``resume()``, its runs, puts and reads raise
        SuspendedError. Its arrays, compiled functions and programs stay valid."""
        if path is not None and not isinstance(path, str):
            raise TypeError(f"suspend's path must be a string (an absolute directory) or None, got {path!r}")
        if self.suspended:
            raise errors.SuspendedError("the session is already suspended; call resume() first")
        with self._puts_lock:
            self.suspended = True  # from here on, no new put starts
        deadline = time.monotonic() + timeout
        try:
            self._wait_for_puts(deadline)
            reply = self.request(lambda req: m.Suspend(req, path or ""), max(0.0, deadline - time.monotonic()))
        except errors.SuspendedError:
            raise
        except BaseException:
            self.suspended = False
            raise
        if reply.warning:
            warnings.warn(f"suspend: {reply.warning}", RuntimeWarning, stacklevel=2)

    def _wait_for_puts(self, deadline: float) -> None:
        """Wait until every put this session started has reached its workers (or failed):
        an array still on its way when the workers offload would not be there to offload."""
        late = errors.DeadlineExceededError(
            "suspend: some of this session's puts were still on their way to the workers when the timeout ran "
            "out; nothing was suspended. Call suspend() again with a longer timeout")
        with self._puts_lock:
            if not self._puts_lock.wait_for(lambda: self._starting_puts == 0, max(0.0, deadline - time.monotonic())):
                raise late
            pending = list(self._puts)
        for future in pending:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise late from None
            except grpc.FutureCancelledError:
                pass

    def resume(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Resume a suspended session: its slices are placed again, on whichever hosts
        (or island) have room, and every array is brought back onto the new devices,
        moved worker to worker; waits up to ``timeout`` seconds. The same pw.Array
        objects, compiled functions and programs keep working. Raises PlacementError,
        with the session still suspended, when its slices do not fit now."""
        if not self.suspended:
            raise errors.SuspendedError("the session is not suspended; call suspend() first")
        self.request(m.Resume, timeout)
        self.suspended = False

    def _refuse_if_suspended(self, what: str) -> None:
        if self.suspended:
            raise errors.SuspendedError(f"cannot {what}: the session is suspended (its arrays are off the devices "
                                        "and its slices released); call resume() (session.resume() or "
                                        "pw.resume()) first")

    def request(self, make: Callable[[int], m.Message], timeout: float = 30.0) -> Any:
        """Send ``make(req)`` and wait for the reply carrying its request id ``req``."""
        req = next(self._req_ids)
        future: Future = Future()
        self._pending[req] = future
        msg = make(req)
        self.send(msg)
        self._outbox.send_held()
        try:
            return self._result(future, timeout, f"answer a {msg.TAG!r} request")
        finally:
            self._pending.pop(req, None)

    def _result(self, future: Future, timeout: float, what: str) -> Any:
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise errors.DeadlineExceededError(
                f"the controller at {self.address} did not {what} within {timeout:.0f} s; "
                "check that it is running (`python -m pathways status`)") from None

    def release(self, handle: int) -> None:
        """Queue ``handle`` for deletion; safe from __del__ in any thread."""
        self.computations.forget(handle)
        self._outbox.release(handle)

    def _read(self) -> None:
        refused = None
        try:
            for payload in self._responses:
                for msg in m.SESSION_DOWN.decode_batch(payload):
                    self._on_message(msg)
            reason = "closed the session"
        except grpc.RpcError as e:
            refused = rpc.refusal(e, self.address)
            reason = _broken(e)
        except Exception as e:  # a malformed reply must not leave waiters hanging
            reason = f"sent a malformed reply ({e})"
        if refused is not None:
            self._dead_error = errors.AuthenticationError  # before _dead: other threads raise it once _dead is set
            self._dead = str(refused)
            error: errors.ConnectError = errors.AuthenticationError(self._dead)
        elif self._closed.is_set():  # this client closed the session: the controller is not to blame
            error = errors.ConnectError(_CLOSED)
        else:
            self._dead_error = errors.ControllerLostError
            self._dead = (f"the controller at {self.address} {reason}; restart it or call pw.connect() "
                          "again (arrays held by this session are gone)")
            error = errors.ControllerLostError(self._dead)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self.computations.close()
        self._cancel_fetches(None)

    def _on_message(self, msg: m.Message | m.Malformed) -> None:
        kind = type(msg)
        if kind is m.SessionWelcome:
            self._welcome.set_result(msg)
        elif kind is m.SliceMoved:
            moved = self.slices.get(msg.slice)
            if moved is not None:
                moved.move(msg.workers, msg.addresses, msg.island, m.device_pairs(msg.devices))
            self.moves += 1  # after the move: a put that read the new addresses reports it
        elif kind is m.Poisoned:
            error = type(error_of(msg.kind, "", errors.RemoteError))
            for h in msg.handles:
                self.poisoned[h] = (error, msg.message)
            self.computations.computed(msg.handles, False)
            self._cancel_fetches(msg.handles)
        elif kind is m.Computed:
            self.computations.computed(msg.handles, not msg.failed, msg.values)
            if msg.values:
                self.array_bytes.add_received(sum(len(raw) for _, raw in msg.values))
        elif kind is m.Compiled:
            future = self._pending.pop(("compiled", msg.fn), None)
            if future is None:
                log.warning("the controller reported function %#x compiled, which this session did not define "
                            "with define_xla", msg.fn)
            elif msg.error:
                future.set_exception(error_of(msg.kind, msg.error, errors.RemoteError))
            else:
                future.set_result(msg)
        elif kind is m.Error or kind is m.Malformed:
            if kind is m.Malformed:
                msg = m.Error(msg.req, kind_of(msg.error), f"the controller sent a malformed {msg.tag!r}: {msg.error}")
            future = self._pending.pop(msg.req, None)
            error = error_of(msg.kind, msg.message)
            if future is not None:
                future.set_exception(error)
            elif "welcome" in self._pending and not self._welcome.done():
                self._welcome.set_exception(error)
            else:
                log.error("controller reported: %s", msg.message)
        elif (future := self._pending.pop(msg.req, None)) is not None:
            future.set_result(msg)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead_error(self._dead)
        if self._closed.is_set():
            raise errors.ConnectError(_CLOSED)

    # ---- data plane ------------------------------------------------------------------

    def _stubs(self, address: str) -> WorkerStubs:
        stubs = self._workers.get(address)
        if stubs is None:
            if self._closed.is_set():  # its channels are gone (_let_go_of_calls)
                raise errors.ConnectError(_CLOSED)
            channel = rpc.open_channel(address, self.security, caller_reads_streams=True)
            stubs = WorkerStubs(rpc.method(channel, rpc.WORKER_SERVICE, "Put", "stream_unary"),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream"), channel,
                                rpc.method(channel, rpc.WORKER_SERVICE, "PutOne", "unary_unary"),
                                m.worker_credential(self._credential, address),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Save", "unary_unary"),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Load", "unary_unary"),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Colocated", "unary_unary"),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Profile", "unary_unary"))
            self._workers[address] = stubs
        return stubs

    def cluster(self) -> dict:
        """The cluster's status, as ``pw.cluster.status`` gives it."""
        return self.request(m.ClusterRequest).status.as_dict()

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self._process_recording is not None and self._dead is None:
            try:  # PATHWAYS_TRACE: the file is written again as each session of the process closes
                self.recordings.stop(self._process_recording)
            except Exception as e:  # closing must not fail for the timeline's sake
                log.warning("could not write the timeline %s: %s", self._process_recording.path, e)
        self._closed.set()
        self.computations.close()
        self._outbox.close()
        self._responses.cancel()
        if self._channel is not None:
            self._channel.close()
        for stubs in self._workers.values():
            stubs.channel.close()
        self._threads.join()
        self._let_go_of_calls()
        if self._owned_cluster is not None:
            self._owned_cluster.stop()

    def _let_go_of_calls(self) -> None:
        """Drop the session's gRPC calls and channels, closed by now, so that they are freed
        here. The session is in reference cycles (its threads' targets, its recordings): what
        it held would otherwise wait for the interpreter's last garbage collection, after
        gRPC's own daemon threads have stopped for good, and a call's finalizer there waits
        for the call's lock, which such a thread may have held when it stopped (a process
        that printed its results never exited). ``api.py`` collects cycles at exit too."""
        self._responses = None
        self._channel = None
        self._workers.clear()
        with self._puts_lock:
            self._puts.clear()
        with self._fetches_lock:
            self._fetches.clear()


def _broken(e: grpc.RpcError) -> str:
    """What a broken session stream says about the controller."""
    code = e.code().name if hasattr(e, "code") else "UNKNOWN"
    details = e.details() if hasattr(e, "details") else ""
    if "ping timeout" in (details or "") or "keepalive" in (details or ""):
        seconds = (rpc.KEEPALIVE_TIME_MS + rpc.KEEPALIVE_TIMEOUT_MS) / 1000
        return f"stopped answering (no reply to keepalive pings within about {seconds:g} s: frozen or unreachable)"
    return f"broke the connection ({code}: {details})" if details else f"broke the connection ({code})"

