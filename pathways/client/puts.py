"""Putting arrays on workers: a part of the client session (Session), working on its state.
Each worker of an array's layout gets the blocks its devices hold (or the whole array),
over the data plane where the session has one, else with gRPC (PutOne for small arrays,
a streamed Put for large ones); the controller then hears of the put (PutNotice). A put
that fails poisons its array with why."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import grpc
import numpy as np

from pathways import errors
from pathways.client.array import Array, _Buffer
from pathways.client.devices import NamedSharding
from pathways.client.fetches import GONE
from pathways.ir import Layout, evenly_divided, host_regions, partials, stacked
from pathways.protocol import messages as m
from pathways.protocol.data import ArrayPut, PutAnswer
from pathways.protocol.errors import answer_error, error_of
from pathways.timeline import now
from pathways.wire import codec, rpc, tcp

log = logging.getLogger("pathways.client")

# Arrays up to this size go to a worker in one unary PutOne message: a streamed Put costs the
# client a thread per call (gRPC's request-iterator consumer).
_PUT_ONE_BYTES = 1 << 20
_SHORT = "the array's bytes did not all arrive"  # a put whose source gave out


class Puts:
    """Session's puts. A put streamed on the data plane runs on a thread of the session's
    (``_threads``), which its close joins."""

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
            self.array_bytes.add_sent(math.prod(shape) * np.dtype(dtype).itemsize)
            stubs = self._stubs(address)
            header = _put_header(stubs.credential, handle, layout, codec.whole_array_header(dtype, shape))
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
        self._threads.start(stream, "pathways-put")

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
            self.array_bytes.add_sent(sum(a.nbytes for _, a in pieces))
            stubs = self._stubs(address)
            header = _put_header(stubs.credential, handle, sent, codec.pieces_header(dtype, shape, pieces),
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
            elif e.code() in GONE:  # the host is gone, or stopped serving to restart (its island heals, or not)
                self.poisoned[handle] = (errors.WorkerLostError, f"the worker at {address} is unreachable or "
                                         f"stopped serving ({e.code().name}), so the array never reached it: it was "
                                         "lost. `python -m pathways status` shows which islands are healthy")
            else:
                self.poisoned[handle] = (errors.RemoteError, f"sending the array to {address} failed: "
                                         f"{e.code().name}")


def _put_header(credential: bytes, handle: int, layout: Layout, pieces: dict,
                unstack: Optional[Layout] = None) -> dict:
    """A put's header (a Put's first message, packed): the array's handle and layout, this
    session's ``credential`` at the worker, ``pieces`` (codec's description of what
    follows), and the unreduced layout whose partial values the array stacks, if it does."""
    return ArrayPut(handle, layout.to_wire(), credential=credential, pieces=pieces,
                    unstack=None if unstack is None else unstack.to_wire()).header()


def _chunks(header: bytes, pieces: list[codec.Piece]) -> Iterator[bytes]:
    yield header
    yield from codec.pieces_chunks(pieces)
