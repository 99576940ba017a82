"""A client session: one long-lived stream to the controller, and the data plane to workers.

Submissions are fire and forget: the client numbers every handle itself, so nothing waits
for the controller except placement and cluster queries. Deletes from dropped arrays are
batched and ride along with the next message (or a periodic flush).

``suspend()`` takes the session's arrays off the devices and releases its slices;
``resume()`` places them again (the controller says where with SliceMoved, and every
slice, array and function follows). In between, runs, puts and reads of its arrays
raise SuspendedError.

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
import dataclasses
import itertools
import logging
import math
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import grpc
import numpy as np

from pathways import errors
from pathways.client.array import Array, _Buffer
from pathways.client.devices import NamedSharding
from pathways.client.timeline import RecordingBlock, Recordings, process_recording
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.ir import Device, Layout, evenly_divided, host_regions, partials, stacked
from pathways.protocol import messages as m
from pathways.protocol import streams
from pathways.protocol.data import ERROR, PENDING, ArrayPut, FetchReply, PutAnswer
from pathways.protocol.errors import answer_error, error_of, kind_of
from pathways.protocol.handles import COUNTER_MASK, discard, first_handle
from pathways.timeline import Recorder, now
from pathways.wire import codec, rpc, tcp
from pathways.wire.security import Security

log = logging.getLogger("pathways.client")

DEFAULT_TIMEOUT = 300.0
# Arrays up to this size go to a worker in one unary PutOne message: a streamed Put costs the
# client a thread per call (gRPC's request-iterator consumer).
_PUT_ONE_BYTES = 1 << 20
_POLL_SECONDS = 1.0  # a long wait for an array is split so news of a lost worker cuts it short
# pauses between fetches that a busy worker answered at once, instead of waiting
_BUSY_PAUSE, _BUSY_PAUSE_MAX = 0.005, 0.2
_VERDICT_SECONDS = 3.0  # how long a failed fetch waits for the controller to say why
# ... when the worker became unreachable: keepalive may give up on a frozen worker before
# the controller judges it (after its heartbeat timeout), and the controller's verdict names
# the host; without one the worker is slow, not lost, and the fetch is asked again
_UNREACHABLE_VERDICT_SECONDS = HEARTBEAT_TIMEOUT
# What a call to a worker ends with when the worker died, or stopped its server to restart
# (its island lost a host): this client cancels its own calls only once it knows why.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_SHORT = "the array's bytes did not all arrive"  # a put whose source gave out
# The library's advice; `pathways demo`, whose user writes no pw.connect() call, words it its own way.
EMBEDDED_ADVICE = "or call pw.connect() with no address (and PATHWAYS_ADDRESS unset) to start an embedded one"
_CONNECT_ADVICE = f"{rpc.START_ADVICE}, {EMBEDDED_ADVICE}"


# Where a fetch's reply goes as it arrives (Session.fetch): the header of one worker's
# pieces and the iterator of their chunks, which the sink reads to the end.
Sink = Callable[[dict, Iterator[bytes]], None]


class WorkerStubs(NamedTuple):
    """The calls this session makes to one worker, over one channel."""

    put: Any  # Put, stream-unary: an array's pieces in chunks
    fetch: Any  # Fetch, unary-stream
    channel: grpc.Channel
    put_one: Any  # PutOne, unary-unary: a small array in one message
    credential: bytes  # what the session presents to this worker (messages.worker_credential)


class Session:
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
                 data_plane: Optional[tcp.Pool] = None) -> None:
        if not 0 < weight <= 1e6:
            raise ValueError(f"a session's weight must be in (0, 1e6], got {weight!r}")
        self.address = address
        self.result_timeout = DEFAULT_TIMEOUT  # how long a put, or a wait for an array, may take by default
        self.security = security or Security()
        self._data_plane = data_plane
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
        self._fetches_lock = threading.Lock()
        # puts on their way to the workers, and puts still starting theirs: suspend waits for both
        self._puts: set[grpc.Future | Future] = set()
        self._starting_puts = 0
        self._puts_lock = threading.Condition()
        self.suspended = False  # from suspend() until resume() returns
        self._closed = threading.Event()
        self._welcome: Future = Future()
        self._pending["welcome"] = self._welcome
        if open_local is not None:  # the controller's loop takes the outbox's batches itself
            self._responses = open_local(self._outbox)
        else:
            stream = rpc.method(self._channel, rpc.CONTROLLER_SERVICE, "Session", "stream_stream")
            self._responses = stream(self._outbox.batches())
        threading.Thread(target=self._read, name="pathways-session", daemon=True).start()
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

    def submit(self, program: int, base: int, args: dict[int, int], what: str) -> None:
        """Send a run of ``program`` whose values start at handle ``base``, with ``args``
        (graph value -> handle) bound. While a recording is open the run is traced and its
        submission recorded, ``what`` naming it on the timeline."""
        traced = self.traced
        if traced:
            began = now()
        self.send(m.Run(program, base, args, traced))
        if traced:
            self.recorder.span("submit", began, base, what)

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
            error = errors.ConnectError("this session is closed; call pw.connect() for a new one")
        else:
            self._dead_error = errors.ControllerLostError
            self._dead = (f"the controller at {self.address} {reason}; restart it or call pw.connect() "
                          "again (arrays held by this session are gone)")
            error = errors.ControllerLostError(self._dead)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
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
            self._cancel_fetches(msg.handles)
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
            raise errors.ConnectError("this session is closed; call pw.connect() for a new one")

    # ---- data plane ------------------------------------------------------------------

    def _stubs(self, address: str) -> WorkerStubs:
        stubs = self._workers.get(address)
        if stubs is None:
            channel = rpc.open_channel(address, self.security, caller_reads_streams=True)
            stubs = WorkerStubs(rpc.method(channel, rpc.WORKER_SERVICE, "Put", "stream_unary"),
                                rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream"), channel,
                                rpc.method(channel, rpc.WORKER_SERVICE, "PutOne", "unary_unary"),
                                m.worker_credential(self._credential, address))
            self._workers[address] = stubs
        return stubs

    def put_layout(self, value: np.ndarray, layout: Layout, sharding: NamedSharding) -> Array:
        """A new pw.Array of host ``value``, sent to the workers of ``sharding``'s slice
        laid out by ``layout``; the array can be used at once."""
        handle = self.allocate(1)
        moves = self.moves  # before the addresses: a move in between makes the controller drop the put
        s = sharding.mesh.slice
        if layout.workers != s.workers or layout.devices != s._physical:  # the slice moved since it was made
            layout = dataclasses.replace(layout, workers=s.workers, devices=s._physical)
        self.put(s.addresses, handle, layout, value, moves)
        return Array(_Buffer(self, handle, s), value.shape, value.dtype, sharding)

    def put(self, addresses: tuple[str, ...], handle: int, layout: Layout, array: np.ndarray,
            moves: Optional[int] = None) -> None:
        """Send ``array`` straight to the workers holding ``layout`` (not through the
        controller; ``addresses[i]`` is that of ``layout.workers[i]``), each only the
        blocks of its own devices, with gRPC or, given a data plane, on each worker's data
        listener. No waiting. ``moves``: how many SliceMoved this session had applied when
        ``addresses`` were read (default: now). For a layout with unreduced axes, ``array``
        is the stack of its partial values (``ir.stacked``)."""
        with self._starting_put():
            self._start_put(addresses, handle, layout, array, self.moves if moves is None else moves)

    def put_pieces(self, addresses: tuple[str, ...], handle: int, layout: Layout, dtype: np.dtype,
                   shape: tuple[int, ...], pieces: dict[int, list[codec.Piece]], moves: int) -> None:
        """``put`` of an array of ``dtype`` and ``shape`` given as the blocks each worker of
        ``layout`` holds (``pieces[worker]``: that worker's ``host_regions``, each with its
        value, which may be a strided view: its bytes are laid out chunk by chunk as they
        are sent), for a caller that has the blocks and not the whole array. Not for
        unreduced layouts. No waiting."""
        if layout.unreduced:
            raise ValueError("put_pieces sends the blocks of an array that is not unreduced; use put")
        with self._starting_put():
            self._send_pieces(addresses, handle, layout, dtype, shape, pieces, moves)

    def put_chunks(self, address: str, handle: int, layout: Layout, dtype: np.dtype, shape: tuple[int, ...],
                   chunks: Iterable[bytes | memoryview], moves: int) -> None:
        """``put`` of an array that the one worker of ``layout`` (at ``address``) holds
        whole, whose bytes in C order come as ``chunks`` (of any sizes): each is sent on as
        it comes, nothing is kept, nothing waits. A source that raises, or ends short,
        poisons the array with why. With a data plane (the IFRT front end's sessions), the
        bytes go on the worker's data listener (with gRPC where the pool has no connection
        for it), else with gRPC."""
        if len(layout.workers) != 1 or layout.unreduced:
            raise ValueError("put_chunks sends an array to the one worker that holds it whole; use put")
        with self._starting_put():
            if self.traced:
                began = now()
            stubs = self._stubs(address)
            header = _put_header(stubs, handle, layout, codec.whole_array_header(dtype, shape))
            connection = self._data_connection(address)
            if connection is not None:
                self._stream_put(connection, address, handle, header, chunks)
            else:
                failed: list[str] = []

                def sent() -> Iterator[bytes]:
                    yield codec.pack(header)
                    try:
                        for chunk in chunks:
                            yield chunk if type(chunk) is bytes else bytes(chunk)
                    except Exception as e:  # the worker then refuses the short array; the put says why
                        failed.append(f"{_SHORT}: {e}")

                self._watch_put(stubs.put.future(sent(), timeout=self.result_timeout),
                                lambda f: self._put_done(f, address, handle, failed))
            self.send(m.PutNotice(handle, layout, moves))
            if self.traced:
                nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                self.recorder.span("put", began, 0, f"array {handle:#x}, {nbytes} bytes, sent as they arrive")

    def _data_connection(self, address: str) -> Optional[tuple[Any, tcp.Route]]:
        """A connection to the data listener of the worker at ``address``, or None (no data
        plane, or the listener is not reachable from this process: put with gRPC)."""
        if self._data_plane is None:
            return None
        try:
            return self._data_plane.take(address)
        except (OSError, errors.ConnectError) as e:
            log.warning("putting through gRPC for %g s: the data listener of the worker at %s refused or did not "
                        "answer this process (%s: %s)", tcp.Pool.UNREACHABLE_SECONDS, address, type(e).__name__, e)
            return None

    def _stream_put(self, connection: tuple[Any, tcp.Route], address: str, handle: int, header: dict,
                    chunks: Iterable[bytes | memoryview]) -> None:
        """Send the array on ``connection`` from a thread of its own, chunk by chunk as they
        come, and poison it if the worker does not store it."""
        assert self._data_plane is not None
        outcome: Future = Future()
        pool = self._data_plane

        def stream() -> None:
            try:
                outcome.set_result(pool.request(connection, header, chunks))
            except BaseException as e:
                outcome.set_exception(e)

        self._watch_put(outcome, lambda f: self._streamed(f, address, handle))
        threading.Thread(target=stream, name="pathways-put", daemon=True).start()

    def _streamed(self, outcome: Future, address: str, handle: int) -> None:
        """A put on the data plane ended: its array is poisoned unless the worker stored it."""
        error = outcome.exception()
        if isinstance(error, OSError):
            self.poisoned[handle] = (errors.WorkerLostError, f"sending the array to the worker at {address} failed "
                                     f"({error}), so it never reached it: it was lost. `python -m pathways status` "
                                     "shows which islands are healthy")
        elif isinstance(error, errors.WireError):
            self.poisoned[handle] = (errors.RemoteError, f"the worker at {address} refused the array: {error}")
        elif error is not None:
            self.poisoned[handle] = (errors.RemoteError, f"{_SHORT}: {error}")
        elif outcome.result() is not None:
            kind, refusal = answer_error(outcome.result())
            self.poisoned[handle] = (type(error_of(kind, "", errors.RemoteError)),
                                     f"the worker at {address} refused the array: {refusal}")

    @contextlib.contextmanager
    def _starting_put(self) -> Iterator[None]:
        """Around starting a put: refused while suspended, and suspending waits for it."""
        self._check_alive()
        with self._puts_lock:
            self._refuse_if_suspended("put an array")
            self._starting_puts += 1
        try:
            yield
        finally:
            with self._puts_lock:
                self._starting_puts -= 1
                self._puts_lock.notify_all()

    def _start_put(self, addresses: tuple[str, ...], handle: int, layout: Layout, array: np.ndarray,
                   moves: int) -> None:
        sent = layout
        if layout.unreduced:  # the stack of partial values goes as an array of its own, unstacked there
            sent = stacked(layout)
            if array.shape[:1] != (partials(layout),):
                raise ValueError(f"an unreduced array's {partials(layout)} partial values come stacked along a "
                                 f"leading dimension; got an array of shape {array.shape}")
        whole = [(codec.full_region(array.shape), array)]
        parts = host_regions(array.shape, sent) if evenly_divided(array.shape, sent) else None
        # each host gets the blocks of its own devices, not the whole array
        pieces = {worker: whole if parts is None else [(r, array[tuple(slice(a, b) for a, b in r)])
                                                       for r in parts[worker]] for worker in layout.workers}
        self._send_pieces(addresses, handle, layout, array.dtype, array.shape, pieces, moves)

    def _send_pieces(self, addresses: tuple[str, ...], handle: int, layout: Layout, dtype: np.dtype,
                     shape: tuple[int, ...], pieces_of: dict[int, list[codec.Piece]], moves: int) -> None:
        """Send each worker of ``layout`` its ``pieces_of`` an array of ``dtype`` and
        ``shape`` (for an unreduced layout, the pieces are of the stack of its partial
        values, which each worker unstacks), then tell the controller."""
        if self.traced:
            began = now()
        sent = stacked(layout) if layout.unreduced else layout
        for worker, address in zip(layout.workers, addresses):
            pieces = pieces_of[worker]
            stubs = self._stubs(address)
            header = _put_header(stubs, handle, sent, codec.pieces_header(dtype, shape, pieces),
                                 unstack=layout if layout.unreduced else None)
            connection = self._data_connection(address)
            if connection is not None:
                self._stream_put(connection, address, handle, header, codec.pieces_chunks(pieces))
                continue
            if sum(a.nbytes for _, a in pieces) <= _PUT_ONE_BYTES:
                request = codec.pack([codec.pack(header), *codec.pieces_chunks(pieces)])
                future = stubs.put_one.future(request, timeout=self.result_timeout)
            else:
                future = stubs.put.future(_chunks(codec.pack(header), pieces), timeout=self.result_timeout)
            self._watch_put(future, lambda f, address=address: self._put_done(f, address, handle))
        self.send(m.PutNotice(handle, layout, moves))
        if self.traced:
            self.recorder.span("put", began, 0, f"array {handle:#x}, {math.prod(shape) * dtype.itemsize} bytes")

    def _watch_put(self, future: grpc.Future | Future, done: Callable[[Any], None]) -> None:
        """Count ``future`` among the puts in flight (suspending waits for them) until it
        ends, then call ``done`` with it."""
        with self._puts_lock:
            self._puts.add(future)

        def ended(f: Any) -> None:
            with self._puts_lock:
                self._puts.discard(f)
            done(f)
        future.add_done_callback(ended)

    def _put_done(self, f: grpc.Future, address: str, handle: int, failed: Sequence[str] = ()) -> None:
        """A gRPC put ended: its array is poisoned unless the worker took it; ``failed``: why
        the put's source gave out, if it did."""
        if failed:
            self.poisoned[handle] = (errors.RemoteError, failed[0])
            return
        try:
            answer = PutAnswer.read(codec.unpack(f.result()))
            if answer.error is not None:
                error = type(error_of(answer.kind, "", errors.RemoteError))
                self.poisoned[handle] = (error, f"the worker at {address} refused the array: {answer.error}")
        except grpc.RpcError as e:
            refused = rpc.refusal(e, address)
            if refused is not None:
                self.poisoned[handle] = (errors.AuthenticationError, str(refused))
            elif e.code() in _GONE:  # the host is gone, or stopped serving to restart (its island heals, or not)
                self.poisoned[handle] = (errors.WorkerLostError, f"the worker at {address} is unreachable or "
                                         f"stopped serving ({e.code().name}), so the array never reached it: it was "
                                         "lost. `python -m pathways status` shows which islands are healthy")
            else:
                self.poisoned[handle] = (errors.RemoteError, f"sending the array to {address} failed: "
                                         f"{e.code().name}")

    def fetch(self, addresses: tuple[str, ...] | Callable[[], tuple[str, ...]], handle: int, wait: float,
              data: bool, device: Optional[Device] = None,
              sink: Optional[Sink] = None) -> Optional[np.ndarray | bool]:
        """Ask the workers holding ``handle`` for it: None while pending after ``wait``
        seconds, True when ready (``data`` false) or the assembled array; raises the
        error that poisoned it (RemoteError, WorkerLostError). ``addresses``: those workers'
        addresses, or a callable giving where they are now, asked again before each request:
        a slice moves when its island heals (SliceMoved), and a run sent just after the heal
        may have been read with the addresses from before. With ``device`` (host rank,
        device index; the addresses then that of its host): that device's own shard only.
        With ``sink`` (and ``data``): each worker's reply goes to it as it arrives (its
        pieces' header and their chunks, which it reads to the end), and True is returned."""
        self._refuse_if_suspended("read an array")
        self._outbox.send_held()  # the run computing the array may be among them
        where = addresses if callable(addresses) else lambda: addresses
        if self.traced:
            began = now()
            try:
                return self._fetch(where, handle, wait, data, device, sink)
            finally:
                self.recorder.span("fetch", began, 0, f"array {handle:#x}" + ("" if data else ", ready?"))
        return self._fetch(where, handle, wait, data, device, sink)

    def _fetch(self, addresses: Callable[[], tuple[str, ...]], handle: int, wait: float, data: bool,
               device: Optional[Device] = None, sink: Optional[Sink] = None) -> Optional[np.ndarray | bool]:
        deadline = time.monotonic() + wait
        assembly = None
        for i in range(len(addresses())):
            pause = _BUSY_PAUSE
            while True:
                self._raise_if_poisoned(handle)
                asked = time.monotonic()
                left = max(deadline - asked, 0.0)
                reply = self._fetch_one(lambda: addresses()[i], handle, min(left, _POLL_SECONDS), data, device,
                                        sink)
                if reply is not None:
                    break
                answered = time.monotonic()
                if answered >= deadline:
                    return None
                if answered - asked < min(left, _POLL_SECONDS) / 2:
                    # answered at once: the worker's fetch waits are taken (worker/sessions.py)
                    time.sleep(min(pause, deadline - answered))
                    pause = min(2 * pause, _BUSY_PAUSE_MAX)
            if sink is not None:
                continue
            if data and device is not None:
                (_, shard), = reply[2]  # the device's one shard, whole
                return shard
            if data:
                dtype, shape, pieces = reply
                if assembly is None:
                    assembly = codec.Assembly(dtype, shape)
                assembly.add(pieces)
        return assembly.result() if data and sink is None else True

    def _raise_if_poisoned(self, handle: int) -> None:
        if handle in self.poisoned:
            error, message = self.poisoned[handle]
            raise error(message)

    def _fetch_one(self, where: Callable[[], str], handle: int, wait: float, data: bool,
                   device: Optional[Device] = None, sink: Optional[Sink] = None) -> Any:
        """One request for ``handle`` to the worker at ``where()``: None while pending (or
        while its worker is unreachable without a verdict, or has moved: ask again), else
        the reply's value; raises the error that poisoned it."""
        self._check_alive()
        address = where()
        stubs = self._stubs(address)
        request = m.pack(m.FetchRequest(handle, wait, data, stubs.credential, device).encode())
        call = None
        fed = False  # whether ``sink`` was given part of a reply: it cannot be given one again
        try:
            call = stubs.fetch(request, timeout=wait + 30.0)
            with self._fetches_lock:
                self._fetches.setdefault(handle, set()).add(call)
            if handle in self.poisoned or self._dead is not None:
                call.cancel()  # the news came while the call was starting
            replies = iter(call)
            reply = FetchReply.read(codec.unpack(next(replies)))
            if reply.state == PENDING:
                return None
            if reply.state == ERROR:
                raise error_of(reply.kind, reply.message, errors.RemoteError)
            if not data:
                return True
            if sink is not None:
                fed = True
                sink(reply.pieces or {}, replies)
                codec.expect_end(replies)
                return True
            result = codec.read_pieces(reply.pieces or {}, replies)
            codec.expect_end(replies)
            return result
        except grpc.RpcError as e:
            refused = rpc.refusal(e, address)
            if refused is not None:
                raise refused from None
            # A worker that died mid-call breaks the call in several ways; the controller's
            # verdict on the handle, which follows within moments, is the better error.
            unreachable = e.code() in _GONE
            deadline = time.monotonic() + (_UNREACHABLE_VERDICT_SECONDS if unreachable else _VERDICT_SECONDS)
            while (handle not in self.poisoned and time.monotonic() < deadline and self._dead is None
                   and where() == address):
                time.sleep(0.02)
            self._raise_if_poisoned(handle)
            self._check_alive()
            if unreachable and not fed:
                # no verdict: the worker moved (its island healed; the array is at its new
                # address), or the controller still has it, slow (stopped, or starved past
                # keepalive), not lost; the array is still to come, so the caller asks again
                log.info("the worker at %s holding array %#x does not answer (%s), but the controller has not "
                         "declared it lost: asking again%s", address, handle, e.code().name,
                         "" if where() == address else f", at its new address {where()}")
                return None
            if unreachable:
                raise errors.ConnectError(
                    f"the worker at {address} stopped answering ({e.code().name}) while it sent array "
                    f"{handle:#x}, but the controller has not declared it lost (it is slow: starved of CPU, busy, "
                    "or stopped); read the array again, and see `python -m pathways status`") from None
            raise errors.ConnectError(
                f"fetching from worker {address} failed ({e.code().name}); check "
                "`python -m pathways status`") from None
        except BaseException:
            if call is not None:
                call.cancel()  # whatever is left of the reply is not wanted
            raise
        finally:
            if call is not None:
                with self._fetches_lock:
                    discard(self._fetches, handle, call)

    def _cancel_fetches(self, handles: Optional[tuple[int, ...]]) -> None:
        """Cancel the fetches in flight for ``handles`` (all of them with None): whoever
        waits in them then raises the error the controller gave, at once."""
        with self._fetches_lock:
            if handles is None:
                doomed = [c for calls in self._fetches.values() for c in calls]
            else:
                doomed = [c for h in handles for c in self._fetches.get(h, ())]
        for call in doomed:
            call.cancel()

    def cluster(self) -> dict:
        return self.request(m.ClusterRequest).status

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self._process_recording is not None and self._dead is None:
            try:  # PATHWAYS_TRACE: the file is written again as each session of the process closes
                self.recordings.stop(self._process_recording)
            except Exception as e:  # closing must not fail for the timeline's sake
                log.warning("could not write the timeline %s: %s", self._process_recording.path, e)
        self._closed.set()
        self._outbox.close()
        self._responses.cancel()
        if self._channel is not None:
            self._channel.close()
        for stubs in self._workers.values():
            stubs.channel.close()
        if self._owned_cluster is not None:
            self._owned_cluster.stop()


def _broken(e: grpc.RpcError) -> str:
    """What a broken session stream says about the controller."""
    code = e.code().name if hasattr(e, "code") else "UNKNOWN"
    details = e.details() if hasattr(e, "details") else ""
    if "ping timeout" in (details or "") or "keepalive" in (details or ""):
        seconds = (rpc.KEEPALIVE_TIME_MS + rpc.KEEPALIVE_TIMEOUT_MS) / 1000
        return f"stopped answering (no reply to keepalive pings within about {seconds:g} s: frozen or unreachable)"
    return f"broke the connection ({code}: {details})" if details else f"broke the connection ({code})"


def _put_header(stubs: WorkerStubs, handle: int, layout: Layout, pieces: dict,
                unstack: Optional[Layout] = None) -> dict:
    """A put's header (a Put's first message, packed): the array's handle and layout, this
    session's credential at the worker, ``pieces`` (codec's description of what follows),
    and the unreduced layout whose partial values the array stacks, if it does."""
    return ArrayPut(handle, layout.to_wire(), credential=stubs.credential, pieces=pieces,
                    unstack=None if unstack is None else unstack.to_wire()).header()


def _chunks(header: bytes, pieces: list[codec.Piece]) -> Iterator[bytes]:
    yield header
    yield from codec.pieces_chunks(pieces)
