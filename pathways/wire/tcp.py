"""The bulk data plane: array bytes between workers over plain TCP, one connection per peer.

gRPC carries control and client traffic; worker-to-worker array bytes go here because
grpcio cannot send from a buffer without copying it into a message and its receiver
cannot read into a preallocated array: measured on the development machine, the best
grpcio stream moved 0.56-0.68x of a raw socket's bytes per second, and the gRPC stream this
replaced 0.13-0.20x inside the cluster (docs/performance-notes.md, "Worker-to-worker
transfers against a raw socket"). Here a sender writes each piece straight from the array's memory,
and the receiver reads it straight into a 64-byte-aligned array that JAX adopts without
another copy.

A frame is a 4-byte big-endian length, a msgpack put header (codec.pieces_header fields
plus handle, layout and sender count), then the raw bytes of each piece in order. Frames
are fire and forget: a receiver that refuses one logs why. A malformed frame closes its
connection (the stream cannot be resynchronized); the sender reconnects for the next one.

A put frame whose header has ``"answer": true`` is answered, once its receiver has taken
it: a frame whose header is a ``FrameAnswer`` (handshake.py: its error None when the array
was stored, else why not). A frame refused for want of memory is read past and answered,
its connection kept; one whose bytes stop coming, or come slower than the minimum pace
(pace.py), is answered with ``closing`` set before its connection closes. ``Pool``
sends such frames, from a source of chunks that may still be arriving, and waits for the
answer: the controller's IFRT front end puts a client's array this way.

A probe frame (a ``Probe`` header, handshake.py, followed by its n bytes, n at most
MAX_PROBE_BYTES) is answered too: the listener reads the bytes and replies on the same
connection with the same header and no payload. ``probe`` uses it to measure a link's
latency and bandwidth on its own connection, so that it never shares a socket with array
traffic.

A connection opened with a ``Security`` or a ticket (``connect``) first sends a hello frame
(a ``Hello``, handshake.py) carrying the cluster's token and the ticket, and waits for its
answer (a ``HelloAnswer``; security.py); a listener that requires the token (or, a
worker's, a ticket: only a worker the controller admitted has one for it, see
messages.data_ticket) answers a connection's first frame with a refusal and closes it
unless that frame is a well-formed hello that passes. With ``data_plane_tls`` both ends
speak TLS.

Nothing waits on a dead or frozen peer for longer than the timeout each side is given (a
worker gives its heartbeat timeout): connecting, each piece of a send (a frozen receiver's
kernel keeps acknowledging until its buffer fills, then the send stalls), and each read
within a frame are bounded by socket timeouts; TCP keepalive and TCP_USER_TIMEOUT end a
connection to a host that vanished (a cut cable) even between frames. Errors name the peer.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import select
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional

import numpy as np

from pathways.errors import WireError
from pathways.threads import Threads
from pathways.wire import codec
from pathways.wire import security as sec
from pathways.wire.addresses import family_of, join_host_port, split_host_port, strip_brackets
from pathways.wire.frames import LENGTH, frame, recv_exactly
from pathways.wire.handshake import HELLO_BYTES, MAX_PROBE_BYTES, FrameAnswer, Hello, Probe
from pathways.wire.liveness import TcpState
from pathways.wire.pace import Pace, TooSlow
from pathways.wire.security import Security

log = logging.getLogger("pathways.wire")

_MAX_HEADER_BYTES = 1 << 20  # a put header names a few pieces and a layout: kilobytes
# A header byte can unpack into a 64-byte Python object (an empty list or map), so while a
# frame's header lives, the frame is charged this many bytes per header byte.
_HEADER_EXPANSION = 64
# The share of a listener's budget that one party (a sending worker, a client session) may
# hold at once: a party that trickles its frames leaves the rest to the others.
PARTY_SHARE = 0.5
_COALESCE_BYTES = 64 * 1024  # pieces up to this size are copied into the frame's one write
# Each connection reads through a buffer this large: a small frame (its length, header and
# coalesced pieces, sent in one write) then arrives in one recv.
_READ_BUFFER = 128 * 1024
_SCRATCH_BYTES = 1 << 20  # probe payloads and refused frames' bytes are read into a buffer this large, and dropped
_SMALL_SCRATCH_BYTES = 64 * 1024  # ... or this large, uncharged, where the budget is spent
# A send is written in pieces this large, each within the timeout (a socket's timeout bounds
# a whole sendall): a large array on a slow link is progress, a stalled peer is not.
_SEND_PIECE = 4 << 20
_KEEPALIVE_PROBES = 5
_ANSWER_GRACE_SECONDS = 0.5  # a sender whose frame was cut waits this long for the listener's reason
_MAX_ANSWER_BYTES = 64 * 1024
# Connections that have not greeted yet (each held by a thread for HELLO_SECONDS at most) a
# listener that requires a greeting serves at once; more are closed as they arrive, so that
# strangers hold a few threads at most however many connections they open.
MAX_UNGREETED = 64
# accept() errors that mean "out of descriptors or memory for now", not "listener closed"
_ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}

# receive(header, pieces) stores one sender's part of an array; returns an error or None
Receive = Callable[[dict, list], Optional[str]]
# admit(hello) checks a connection's hello beyond the token (a worker's: its peer's ticket);
# returns the refusal to answer, or None
Admit = Callable[[Hello], Optional[str]]
# screen(sender, header) says, before a frame's bytes are read, whether to read the frame that
# the sender ``admit`` let in (its Hello's sender) sent: None to read it, else the refusal
Screen = Callable[[int, Any], Optional[str]]
# parties(sender, header) names whom a frame's bytes are charged to besides the listener's
# budget (``Budget``): the sender its hello proved (None without ``admit``), a session, ...
Parties = Callable[[Optional[int], dict], tuple[Hashable, ...]]


class Budget:
    """The bytes that frames being received may hold, across all connections of a listener.
    A frame reserves its buffers here before allocating them and releases them once its
    receiver has taken them, so many peers announcing large frames and trickling their
    bytes cannot together hold more than ``capacity``. A frame is charged to its parties
    too (a sender, a client session: the listener's ``parties`` names them), each of which
    may hold at most ``share`` of the capacity at once, so that no one sender or session
    holds all of it while others' transfers wait."""

    def __init__(self, capacity: int, share: float = PARTY_SHARE) -> None:
        self.capacity = capacity
        self.share = int(capacity * share)
        self._used = 0
        self._held: dict[Hashable, int] = {}  # party -> bytes its frames hold
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def held(self, party: Hashable) -> int:
        return self._held.get(party, 0)

    def reserve(self, nbytes: int, timeout: float, parties: tuple[Hashable, ...] = ()) -> Optional[str]:
        """Take ``nbytes`` for a frame of ``parties``, waiting up to ``timeout`` seconds for
        other frames to finish; None once taken, else why not (the budget or a party's
        share stayed short)."""
        if nbytes > self.capacity:
            return f"more than this listener's whole budget of {self.capacity} bytes"
        if parties and nbytes > self.share:
            return f"more than the {self.share} bytes that one {_party(parties[0])} may hold here"

        def fits() -> bool:
            return (self._used + nbytes <= self.capacity
                    and all(self._held.get(p, 0) + nbytes <= self.share for p in parties))

        with self._changed:
            if not self._changed.wait_for(fits, timeout):
                full = next((p for p in parties if self._held.get(p, 0) + nbytes > self.share), None)
                if full is not None:
                    return (f"other frames of {_party(full)} hold {self._held.get(full, 0)} of the {self.share} bytes "
                            f"it may hold here for longer than {timeout:g} s")
                return (f"frames on other connections hold {self._used} of this listener's budget of "
                        f"{self.capacity} bytes for longer than {timeout:g} s")
            self._used += nbytes
            if nbytes:  # a party holding nothing has no entry
                for p in parties:
                    self._held[p] = self._held.get(p, 0) + nbytes
            return None

    def release(self, nbytes: int, parties: tuple[Hashable, ...] = ()) -> None:
        with self._changed:
            self._used -= nbytes
            if nbytes:
                for p in parties:
                    left = self._held[p] - nbytes
                    if left:
                        self._held[p] = left
                    else:
                        del self._held[p]
            self._changed.notify_all()


def _party(party: Hashable) -> str:
    """A party's name in an error: ("worker", 3) -> "worker 3"."""
    return " ".join(map(str, party)) if isinstance(party, tuple) else str(party)


class _OverBudget(WireError):
    """A frame refused because the listener's budget, or its party's share of it, stayed
    short: its bytes are read past and the connection kept."""


def _sender_party(sender: Optional[int], header: dict) -> tuple[Hashable, ...]:
    """The parties a frame is charged to where the listener's owner names none: its sender."""
    return () if sender is None else (("sender", sender),)


class _Refused(WireError):
    """A connection whose greeting was refused: answered with the refusal, then closed;
    ``reason`` is what this listener logs."""

    def __init__(self, refusal: str, reason: str) -> None:
        super().__init__(refusal)
        self.reason = reason


class Listener:
    """Accepts peers' connections on a port of ``host`` (loopback unless told otherwise)
    and hands every frame to ``receive``. ``security``: the token a connection's first frame
    must carry (security.py), and TLS if its ``data_plane_tls`` is set; ``admit``: a check
    of that hello beyond the token (a worker's listener requires its peer's ticket), which
    makes the hello required even where no token is. Where a hello is required, at most
    MAX_UNGREETED connections that have not greeted yet are served at once (each for
    HELLO_SECONDS at most); more are closed as they arrive (counted in ``turned_away``).
    Refused greetings are counted in ``refused``, and logged sparsely (``security.Refusals``).
    ``screen`` (with ``admit``): a check of each frame's header, by the sender its
    connection's hello named, before the frame's bytes are read; a frame it refuses is read
    past into a scratch buffer (none of it kept, the connection kept) and answered with the
    refusal if it asked for an answer. The screen counts and logs its own refusals.

    Memory is bounded: a frame (its header and its pieces) may hold at most
    ``connection_bytes`` (by default a quarter of this host's memory), and all frames being
    received at once at most ``budget_bytes`` (by default half of it), of which one party
    (``parties``: by default the sender a hello proved) at most PARTY_SHARE. A frame that
    cannot reserve its bytes within ``timeout`` seconds is refused: waiting a while lets a
    burst of legitimate transfers through one after another, and refusing after it keeps a
    peer that never finishes from stalling every other one. A refused frame's bytes are read
    past (none kept, the connection kept) and the refusal answered, or, for a frame that
    asked for no answer, handed to the receiver in the array's place as a poison (the run
    that reads the array fails, naming the budget). A frame's bytes must keep the minimum
    pace (pace.py) as they come, or the frame is dropped and its connection closed.
    """

    def __init__(self, receive: Receive, timeout: float, host: str = "127.0.0.1", security: Security | None = None,
                 budget_bytes: int | None = None, connection_bytes: int | None = None,
                 admit: Admit | None = None, screen: Screen | None = None, parties: Parties | None = None) -> None:
        if screen is not None and admit is None:
            raise ValueError("a data listener screens frames by the sender a hello proved: screen needs admit")
        self._security = security or Security()
        self._admit = admit
        self._screen = screen
        self._parties = parties or _sender_party
        sec.check_bind(host, self._security, "the worker's data listener")
        self._tls = sec.server_context(self._security) if self._security.data_plane_tls else None
        self._receive = receive
        self._timeout = timeout
        memory = codec.host_memory_bytes()
        self.budget = Budget(memory // 2 if budget_bytes is None else budget_bytes)
        self._connection_bytes = memory // 4 if connection_bytes is None else connection_bytes
        self._server = socket.create_server((strip_brackets(host), 0), family=family_of(host))
        self.port: int = self._server.getsockname()[1]
        self.address = f"tcp://{join_host_port(host, self.port)}"  # where it listens (peers may need another host)
        self._closed = False
        self._greets = self._security.token is not None or admit is not None  # a hello comes first
        self._ungreeted = 0  # connections served that have not greeted yet
        self.turned_away = sec.Refusals()  # connections closed on arrival: MAX_UNGREETED others had not greeted
        self.refused = sec.Refusals()  # connections refused at their greeting
        self.over_budget = sec.Refusals()  # frames refused: the budget, or their party's share, stayed short
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # served now: close() shuts them down
        self._threads = Threads("a data listener")
        self._threads.start(self._accept, "pathways-data-accept")

    def _stranger(self) -> bool:
        """Count in a new connection that has yet to greet; False (turned away) when
        MAX_UNGREETED have not greeted yet."""
        with self._lock:
            if self._ungreeted >= MAX_UNGREETED:
                return False
            self._ungreeted += 1
            return True

    def _greeted(self) -> None:
        with self._lock:
            self._ungreeted -= 1

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError as e:
                if self._closed or e.errno not in _ACCEPT_RETRY:
                    return  # closed
                log.error("a data listener cannot accept connections for now (%s); retrying", e)
                time.sleep(0.1)
                continue
            if self._greets and not self._stranger():
                if turned_away := self.turned_away.add():
                    log.warning("turned a data connection away: %d others have not greeted yet (%d turned away "
                                "so far)", MAX_UNGREETED, turned_away)
                conn.close()
                continue
            with self._lock:
                closing = self._closed
                if not closing:
                    self._connections.add(conn)  # before its thread: close() ends every one it may miss
            if closing:  # accepted as close() began: nobody is left to serve it
                conn.close()
                if self._greets:
                    self._greeted()
                return
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(conn, self._timeout)
                self._threads.start(self._serve, "pathways-data-in", conn)
            except (OSError, RuntimeError) as e:  # the peer left already; or no thread can start
                log.error("dropped a data connection: %s: %s", type(e).__name__, e)
                with self._lock:
                    self._connections.discard(conn)
                conn.close()
                if self._greets:  # no thread took it: give its count back here
                    self._greeted()

    def _serve(self, conn: socket.socket) -> None:
        raw = conn  # as accepted; TLS wraps it below
        ungreeted = self._greets  # counted among the connections that have not greeted (``_stranger``)
        hello_by = time.monotonic() + sec.HELLO_SECONDS if ungreeted else None
        try:
            if self._tls is not None:
                conn.settimeout(sec.HELLO_SECONDS)  # a stranger may not hold a thread for longer
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except OSError as e:  # ssl.SSLError is one
                    log.warning("closing a data connection whose TLS handshake failed (the peer must use "
                                "--data-plane-tls too, and trust this worker's certificate): %s", e)
                    conn.close()
                    return
            with conn:
                reader = _Reader(conn, self._timeout, hello_by)
                greeted = not self._greets
                while True:
                    try:
                        greeted = self._frame(reader, greeted)
                        if greeted is None:
                            return
                        if greeted and ungreeted:
                            ungreeted = False
                            reader.until = None
                            self._greeted()
                    except _Refused as e:
                        if refused := self.refused.add():
                            log.warning("refused a data connection: %s (%d refused so far)", e.reason, refused)
                        try:
                            conn.sendall(sec.answer(str(e)))
                        except OSError:
                            pass
                        return
                    except WireError as e:
                        # the text, not the exception: a handler that keeps records would keep its
                        # traceback, and with it the frame's buffers
                        log.error("closing a data connection after a refused frame: %s", str(e))
                        return
                    except OSError:
                        return  # the peer left, or stalled within a frame
                    except Exception:  # a bug here or in the receiver must not go unnoticed, nor leak the connection
                        log.exception("closing a data connection after an unexpected error")
                        return
        finally:
            if ungreeted:
                self._greeted()
            with self._lock:
                self._connections.discard(raw)

    def _frame(self, reader: "_Reader", greeted: bool) -> bool | None:
        """Read and handle one frame; None once the connection ended, else whether it has
        been greeted (with the token, where one is required): only a hello may come before."""
        # Between frames a peer may stay quiet for as long as it likes, once greeted; within
        # a frame each read waits at most the timeout.
        if not reader.wait_for_frame(None if greeted else sec.HELLO_SECONDS):
            return None
        length = reader.take(LENGTH.size)
        if length is None:
            return None
        (n,) = LENGTH.unpack(length)
        if not greeted and n > HELLO_BYTES:
            raise _Refused(sec.refusal("worker"), f"its first frame ({n} bytes) is too long to be a hello")
        if n > _MAX_HEADER_BYTES:
            raise WireError(f"a data frame header of {n} bytes exceeds {_MAX_HEADER_BYTES}")
        held: list[tuple[int, tuple[Hashable, ...]]] = []  # what the frame reserved, and for whom
        reader.start_pace("a data frame", n)
        try:
            self._reserve(held, n * _HEADER_EXPANSION, (), "its header")
            raw = reader.take(n) if n <= _READ_BUFFER else reader.read(n)
            if raw is None:
                return None
            header = codec.unpack(raw)
            del raw
            if Hello.is_one(header) or not greeted:
                return self._hello(reader, header)
            if not isinstance(header, dict):
                raise WireError("a data frame header must be a map")
            if Probe.is_one(header):
                n = Probe.read(header).nbytes
                reader.pace.expect(n)
                self._reserve(held, min(n, _SCRATCH_BYTES), (), "a probe")
                return self._answer_probe(reader, n)
            return self._data(reader, held, header)
        finally:
            reader.pace = None
            for nbytes, parties in held:
                self.budget.release(nbytes, parties)

    def _hello(self, reader: "_Reader", header: Any) -> bool:
        """A connection's first frame: admitted (answered, True) with the cluster's token
        and, where the listener screens peers, as a peer it knows; else _Refused."""
        hello, why = sec.admitted(self._security, header)
        if hello is None:
            raise _Refused(sec.refusal("worker"), why)
        refused = self._admit(hello) if self._admit is not None else None
        if refused is not None:
            raise _Refused(refused, refused)
        reader.sender = hello.sender
        reader.conn.sendall(sec.answer(None))
        return True

    def _data(self, reader: "_Reader", held: list[tuple[int, tuple[Hashable, ...]]], header: dict) -> bool | None:
        """A data frame whose ``header`` was read: its pieces read within the budget (or
        read past, refused), then handed on; None once the connection ended."""
        answered = header.get("answer") is True
        poison = "poison" in header  # a poison stands for the array: it carries no pieces
        if not poison:
            dtype, _, specs = codec.piece_specs(header)
            sizes = [dtype.itemsize * math.prod(shape) for _, shape in specs]
        nbytes = 0 if poison else sum(sizes)
        reader.pace.expect(nbytes)
        if self._screen is not None:
            refusal = self._screen(reader.sender, header)
            if refusal is not None:  # its bytes are read past, none kept; the next frame may be welcome
                return self._refuse(reader, held, header, nbytes, refusal, answered, poison=False)
            reader.start_pace("a data frame", nbytes)  # the screen may have waited: the bytes' time starts now
        pieces: Optional[list] = []
        if not poison:
            parties = self._parties(reader.sender, header)
            try:
                self._reserve(held, nbytes, parties, (len(specs), dtype))
            except _OverBudget as e:  # wait for nothing more: read the bytes past and say why
                if over := self.over_budget.add():
                    log.error("refused a data frame of %s: %s (%d refused so far)",
                              ", ".join(map(_party, parties)) or "a peer", e, over)
                return self._refuse(reader, held, header, nbytes, str(e), answered, poison=True)
            except WireError as e:  # the sender waits for an answer: give it this one, then close
                if answered:
                    _answer_closing(reader.conn, str(e))
                raise
            pieces = self._read_pieces(reader, header, answered, dtype, specs, sizes)
            if pieces is None:
                return None
        error = self._receive(header, pieces)
        if answered:
            reader.conn.sendall(FrameAnswer(error).frame())
        elif error:
            log.error("refused an array from a peer: %s", error)
        return True

    def _read_pieces(self, reader: "_Reader", header: dict, answered: bool, dtype: np.dtype, specs: list,
                     sizes: list[int]) -> Optional[list]:
        """The frame's pieces, each read into an aligned array of its own; None once the
        connection ended. A sender that stops or trickles is told why (where it reads
        answers) before the error ends the connection."""
        pieces = []
        try:
            for (index, shape), size in zip(specs, sizes):
                array = codec.aligned_empty(shape, dtype)
                if size and not reader.read_into(memoryview(array.reshape(-1).view(np.uint8))):
                    return None
                pieces.append((index, array))
        except TooSlow as e:  # a trickle: the sender is told, or the array's reader
            self._drop_too_slow(reader, header, answered, str(e))
            raise
        except (OSError, WireError) as e:  # they stopped: say so to a sender that reads answers, then close
            if answered:
                _answer_closing(reader.conn, f"its bytes stopped coming ({type(e).__name__}: {e})")
            raise
        return pieces

    def _reserve(self, held: list[tuple[int, tuple[Hashable, ...]]], nbytes: int, parties: tuple[Hashable, ...],
                 what: str | tuple[int, np.dtype]) -> None:
        """Reserve ``nbytes`` more, for ``parties``, for a frame that holds ``held`` (to
        which the reservation is added); WireError if the frame would exceed its
        connection's cap, _OverBudget if the listener's budget or a party's share stays
        short. ``what`` says what for: words, or the count and dtype of an array's pieces
        (worded only for an error: formatting a dtype costs more than the reservation)."""
        total = sum(n for n, _ in held) + nbytes
        if total > self._connection_bytes:
            raise WireError(f"a data frame needs {total} bytes for {_worded(what)}, more than the "
                            f"{self._connection_bytes} bytes one connection may hold; send smaller pieces")
        short = self.budget.reserve(nbytes, self._timeout, parties)
        if short is not None:
            raise _OverBudget(f"a data frame needs {nbytes} bytes for {_worded(what)}, {short}; retry when they "
                              "are done, or send smaller pieces")
        held.append((nbytes, parties))

    def _refuse(self, reader: "_Reader", held: list[tuple[int, tuple[Hashable, ...]]], header: dict,
                   nbytes: int, refusal: str, answered: bool, poison: bool) -> bool | None:
        """Refuse a frame whose header has been read: read its ``nbytes`` past (none kept),
        then answer the sender with ``refusal``, or, where it asked for no answer and
        ``poison`` says the array is awaited, hand the receiver a poison in its place."""
        try:
            if not _read_past(reader, nbytes, self._reserve_scratch(held, min(nbytes, _SCRATCH_BYTES))):
                return None
        except TooSlow as e:  # a refused trickle: told why it ends, if it listens; no poison for it
            if answered:
                _answer_closing(reader.conn, str(e))
            raise
        if answered:
            reader.conn.sendall(FrameAnswer(refusal).frame())
        elif poison:
            self._poisoned(header, refusal)
        return True

    def _reserve_scratch(self, held: list[tuple[int, tuple[Hashable, ...]]], nbytes: int) -> int:
        """The size of the scratch buffer a refused frame's bytes are read into: ``nbytes``,
        charged to the budget, where it has them now (a refusal is not queued behind the
        frames it was refused for), else a small one."""
        if self.budget.reserve(nbytes, 0.0) is None:
            held.append((nbytes, ()))
            return nbytes
        return min(nbytes, _SMALL_SCRATCH_BYTES)

    def _drop_too_slow(self, reader: "_Reader", header: dict, answered: bool, why: str) -> None:
        """A frame whose bytes came too slowly is dropped: its sender is told, if it reads
        answers, else its receiver gets a poison in the array's place (a sender that died
        mid-frame gets none: its island's loss is what the array's reader learns)."""
        if answered:
            _answer_closing(reader.conn, why)
        else:
            self._poisoned(header, f"the data listener dropped the array: {why}")

    def _poisoned(self, header: dict, why: str) -> None:
        """Hand the receiver the array of ``header`` as a poison saying ``why``: whoever
        waits for it learns why it will not come. The poison carries no kind (the error its
        reader gets), so the receiver's default applies: a failed array, not a lost host."""
        error = self._receive({**header, "poison": why}, [])
        if error:
            log.error("a refused array could not be poisoned: %s", error)

    def _answer_probe(self, reader: "_Reader", n: int) -> bool | None:
        if not _read_past(reader, n, min(n, _SCRATCH_BYTES)):
            return None
        reader.conn.sendall(Probe(n).frame())
        return True

    def close(self) -> None:
        """Stop accepting, end the connections being served (a frame in flight is dropped:
        its sender hears the connection close) and join their threads."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            # wakes the accepting thread; a plain close leaves the port listening while it waits
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes its reader; its thread closes it
        self._threads.join()


class _Reader:
    """A connection's bytes, read through a buffer, so that a small frame costs one recv
    and no change of the socket's timeout: the socket blocks while it waits for a frame to
    begin, and gets the per-read timeout only when a frame is still incomplete after its
    first read. Large pieces go from the socket straight into their arrays. Within a frame
    (``start_pace``), every byte read counts towards its pace, which ends a trickle."""

    def __init__(self, conn: socket.socket, timeout: float, until: Optional[float] = None) -> None:
        self.conn = conn
        self._timeout = timeout
        # While set, no read waits past this time.monotonic(), and none starts after it
        # (TimeoutError): a connection that has not greeted must have sent all of its hello
        # within HELLO_SECONDS, however slowly its bytes come.
        self.until = until
        self._buffer = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # the unread bytes are _buffer[_start:_end]
        self._waits: Optional[float] = -1.0  # the timeout given to the socket (None: it blocks); none yet
        self.sender: Optional[int] = None  # who its hello proved the peer is (a listener's ``admit``)
        self.pace: Optional[Pace] = None  # of the frame being read

    def start_pace(self, what: str, nbytes: int) -> None:
        """The frame's next ``nbytes`` (some of them read into the buffer already) must keep
        the minimum pace from now on."""
        self.pace = Pace(what, nbytes, grace=self._timeout)
        self.pace.arrived(min(nbytes, self._end - self._start))

    def _wait(self, timeout: Optional[float]) -> None:
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError("the connection did not greet in time")
            timeout = left if timeout is None else min(timeout, left)
        if self._waits != timeout:
            self.conn.settimeout(timeout)
            self._waits = timeout

    def _recv_into(self, view: memoryview) -> int:
        n = self.conn.recv_into(view)
        if n and self.pace is not None:
            self.pace.arrived(n)
        return n

    def _fill(self) -> bool:
        """Append what the socket has to the buffer (at least a byte); False at its end."""
        n = self._recv_into(self._view[self._end:])
        self._end += n
        return n > 0

    def wait_for_frame(self, idle: Optional[float]) -> bool:
        """Wait up to ``idle`` seconds (None: for ever) for the next frame to begin; False
        if the connection ended first. TimeoutError if it did not begin in time."""
        if self._start < self._end:
            return True
        self._start = self._end = 0
        self._wait(idle)
        return self._fill()

    def take(self, n: int) -> Optional[memoryview]:
        """The next ``n`` bytes (at most the buffer's size) as a view of the buffer, valid
        until the next read; None if the connection ended first."""
        if self._end - self._start < n:
            if len(self._buffer) - self._start < n:  # move the unread bytes to the front
                unread = self._end - self._start
                self._buffer[:unread] = self._buffer[self._start:self._end]
                self._start, self._end = 0, unread
            while self._end - self._start < n:
                self._wait(self._timeout)
                if not self._fill():
                    return None
        view = self._view[self._start:self._start + n]
        self._start += n
        return view

    def read_into(self, view: memoryview) -> bool:
        """Fill ``view``: from the buffer first, then straight from the socket; False if
        the connection ended first."""
        k = min(len(view), self._end - self._start)
        view[:k] = self._view[self._start:self._start + k]
        self._start += k
        view = view[k:]
        if view:
            self._wait(self._timeout)
        while view:
            n = self._recv_into(view)
            if n == 0:
                return False
            view = view[n:]
        return True

    def read(self, n: int) -> Optional[bytearray]:
        """The next ``n`` bytes, in a buffer of their own; None if the connection ended."""
        out = bytearray(n)
        return out if self.read_into(memoryview(out)) else None


def _read_past(reader: _Reader, n: int, scratch_bytes: int) -> bool:
    """Read the next ``n`` bytes and drop them, through a scratch buffer of
    ``scratch_bytes``; False if the connection ended first."""
    scratch = memoryview(bytearray(max(1, min(n, scratch_bytes))))
    left = n
    while left:
        step = min(left, len(scratch))
        if not reader.read_into(scratch[:step]):
            return False
        left -= step
    return True


def _worded(what: str | tuple[int, np.dtype]) -> str:
    return what if isinstance(what, str) else f"{what[0]} pieces of a {what[1]} array"


def keep_alive(sock: socket.socket, timeout: float) -> None:
    """Have the kernel end ``sock`` within about ``timeout`` seconds once its peer's host
    stops answering (a dead host, a cut cable), even while nothing is being sent: keepalive
    probes after half the timeout, then ``_KEEPALIVE_PROBES`` of them over the other half,
    and data left unacknowledged for the timeout aborts the connection. A frozen process's
    kernel still answers these: the socket timeouts catch that case."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(timeout / 2))
    options = [("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, int(timeout / 2 / _KEEPALIVE_PROBES))),
               ("TCP_KEEPCNT", _KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", max(1, int(timeout * 1000)))]
    for name, value in options:
        if hasattr(socket, name):  # Linux has them all; elsewhere the socket timeouts still bound every wait
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# The head of Linux's struct tcp_info (linux/tcp.h, unchanged since 2.6): eight one-byte fields
# (state, ca_state, retransmits, probes, backoff, options, wscales, flags), then 32-bit ones
# from tcpi_rto to tcpi_last_ack_recv.
_TCP_INFO = struct.Struct("=8B13I")
_TCP_ESTABLISHED = 1


def tcp_state(sock: Any) -> Optional[TcpState]:
    """What this host's kernel knows of ``sock``'s connection (a socket, or asyncio's
    wrapper of one), from TCP_INFO: a few microseconds, no packet sent. None off Linux, or
    once the socket is closed."""
    if sys.platform != "linux":
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except (OSError, ValueError):  # closed, or not a TCP socket any more
        return None
    if len(info) < _TCP_INFO.size:
        return None
    fields = _TCP_INFO.unpack(info)
    state, retransmits, probes, unacked = fields[0], fields[2], fields[3], fields[12]
    last_data_recv, last_ack_recv = fields[19], fields[20]  # milliseconds
    # Retrying: data sent, resent and still unacknowledged; or, while the peer's window is
    # closed (it reads nothing), two window probes unanswered: one alone may be counted
    # after its answer came (measured over loopback and a veth pair: a probe answered at
    # once leaves the count at 1, each unanswered one adds 1).
    return TcpState(open=state == _TCP_ESTABLISHED, heard=last_data_recv / 1000, acked=last_ack_recv / 1000,
                    retrying=(unacked > 0 and retransmits > 0) or probes >= 2)


def connect(address: str, timeout: float, security: Security | None = None, tls: bool | None = None,
            ticket: tuple[int, bytes] | None = None) -> socket.socket:
    """A connection to ``tcp://HOST:PORT``, opened within ``timeout`` seconds (OSError
    naming the address if not; ValueError for an address not of the form tcp://HOST:PORT),
    with Nagle's delay off (frames are sent whole, and a small one must not wait for the
    acknowledgement of the last), every blocking call on it bounded by ``timeout``, and
    keepalive on.

    With ``security``: over TLS if ``tls`` (by default its ``data_plane_tls``), then greeted
    with its token and ``ticket`` (security.greet; a worker's listener requires a ticket):
    AuthenticationError if the peer refuses it, ConnectError if the handshake or the
    greeting fails."""
    host, port = split_host_port(address.removeprefix("tcp://"))
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"connecting to {address} took longer than {timeout:g} s: its host is down, "
                           "frozen or unreachable") from None
    except OSError as e:
        raise ConnectionError(f"could not connect to {address}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock, timeout)
        if security is not None or ticket is not None:
            security = security or Security()
            if security.data_plane_tls if tls is None else tls:
                sock = sec.wrap_client(sock, security, host, address)
            sec.greet(sock, security, address, timeout, ticket)
    except BaseException:
        sock.close()
        raise
    return sock


def send_frame(sock: socket.socket, header: dict, pieces: list) -> None:
    """Send one frame on ``sock``: ``header`` and the arrays of ``pieces`` (``(index, array)``
    pairs), as a worker sends them to a peer's listener."""
    _send_parts(sock, *_frame_parts(header, pieces))


def send_all(sock: socket.socket, data: Any) -> None:
    """Send ``data`` (bytes or a buffer) in pieces of at most ``_SEND_PIECE`` bytes, so that
    the socket's timeout bounds each piece rather than the whole."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _SEND_PIECE):
        sock.sendall(view[start:start + _SEND_PIECE])


def peer_error(address: str, timeout: float, error: OSError) -> OSError:
    """``error``, met talking to the peer at ``address``, as an error that names the peer."""
    if isinstance(error, TimeoutError):
        return TimeoutError(f"the peer at {address} took nothing for {timeout:g} s: it is frozen or unreachable")
    return ConnectionError(f"the connection to the peer at {address} failed: {error}")


def _frame_parts(header: dict, pieces: list) -> tuple[bytes, list[np.ndarray]]:
    head = frame(codec.pack(header))
    arrays = [np.ascontiguousarray(array) for _, array in pieces]
    if sum(a.nbytes for a in arrays) <= _COALESCE_BYTES:  # one write, one wakeup of the receiver
        head += b"".join(a.tobytes() for a in arrays)
        arrays = []
    return head, arrays


def _send_parts(sock: socket.socket, head: bytes, arrays: list[np.ndarray]) -> None:
    send_all(sock, head)
    for data in arrays:
        if data.nbytes:
            send_all(sock, data.reshape(-1).view(np.uint8))


# what a sender shows the listener at an address: (its worker id, its ticket there)
Tickets = Callable[[str], tuple[int, bytes]]


class Links:
    """Connections to peers' listeners, opened on first use (with ``security`` and the
    ticket ``tickets`` gives for the address: see ``connect``) and reopened after a
    failure."""

    def __init__(self, timeout: float, security: Security | None = None, tickets: Tickets | None = None) -> None:
        self._timeout = timeout
        self._security = security
        self._tickets = tickets
        self._links: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self._lock = threading.Lock()

    def send(self, address: str, header: dict, pieces: list) -> None:
        """Send one frame; raises OSError naming the peer if it cannot be reached, or stops
        taking bytes for the timeout, ConnectError (AuthenticationError) if it refuses the
        connection."""
        head, arrays = _frame_parts(header, pieces)  # copies, if any, outside the link's lock
        sock, lock = self._link(address)
        with lock:
            try:
                _send_parts(sock, head, arrays)
            except OSError as e:
                self._drop(address, sock)
                raise peer_error(address, self._timeout, e) from None

    def _link(self, address: str) -> tuple[socket.socket, threading.Lock]:
        with self._lock:
            link = self._links.get(address)
        if link is not None:
            return link
        ticket = self._tickets(address) if self._tickets is not None else None
        # unlocked: an unreachable peer must not hold up sends to others
        sock = connect(address, self._timeout, self._security, ticket=ticket)
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = (sock, threading.Lock())
                return link
        sock.close()  # another sender connected first
        return link

    def _drop(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            if self._links.get(address, (None,))[0] is sock:
                del self._links[address]
        sock.close()

    def close(self) -> None:
        with self._lock:
            for sock, _ in self._links.values():
                sock.close()
            self._links.clear()


def _answer_closing(conn: socket.socket, error: str) -> None:
    """Tell the sender on ``conn`` why its frame is dropped, before the connection closes
    (a sender already gone hears nothing). The sender may still be writing: closing with
    its bytes unread would reset the connection, and a reset can discard the answer before
    the sender reads it, so the listener stops writing and reads past what still comes for
    a moment (_ANSWER_GRACE_SECONDS) first."""
    with contextlib.suppress(OSError):
        conn.sendall(FrameAnswer(error, closing=True).frame())
        conn.shutdown(socket.SHUT_WR)
        _drain(conn, time.monotonic() + _ANSWER_GRACE_SECONDS)


def _drain(conn: socket.socket, until: float) -> None:
    """Read and drop what ``conn`` brings until the peer closes it or ``until``."""
    scratch = bytearray(_SMALL_SCRATCH_BYTES)
    while (left := until - time.monotonic()) > 0:
        conn.settimeout(left)
        if conn.recv_into(scratch) == 0:
            return


@dataclass(frozen=True)
class Route:
    """How to reach one listener: its address (``tcp://HOST:PORT``), whether it speaks TLS,
    and what to show it (a sender id and its ticket there)."""

    address: str
    tls: bool
    ticket: tuple[int, bytes]


class Pool:
    """Connections to the listeners ``routes`` names (by a key of the caller's: the
    controller's is a worker's gRPC address), for answered put frames, each used by one
    sender at a time: ``take`` gives an idle connection or opens one, ``request`` sends a
    frame on it and waits for its answer, then keeps the connection for the next (at most
    IDLE_PER_ADDRESS idle ones per address). A connection that failed is closed. ``take``
    answers None, so that the caller puts another way, while OPEN_PER_ADDRESS connections to
    the address are in use (a burst of puts costs no more connections and threads on either
    side) and for UNREACHABLE_SECONDS after its listener could not be reached (so that the
    caller does not wait on it each time). Every blocking call is bounded by ``timeout``
    seconds; the answer too, counted from the last byte sent."""

    IDLE_PER_ADDRESS = 4
    OPEN_PER_ADDRESS = 16
    UNREACHABLE_SECONDS = 60.0

    def __init__(self, routes: Callable[[str], Optional[Route]], timeout: float,
                 security: Security | None = None) -> None:
        self._routes = routes
        self._timeout = timeout
        self._security = security or Security()
        self._idle: dict[str, list[socket.socket]] = {}
        self._open: dict[str, int] = {}  # address -> its connections, idle or in use
        self._unreachable: dict[str, float] = {}  # address -> time.monotonic() until which it is not tried
        self._lock = threading.Lock()
        self._closed = False

    def take(self, key: str) -> Optional[tuple[socket.socket, Route]]:
        """A connection to the listener of ``key`` for one ``request``, and its route; None
        where ``routes`` knows none, OPEN_PER_ADDRESS connections to it are in use, or its
        listener was unreachable within the last UNREACHABLE_SECONDS. OSError naming the
        address if it cannot be reached, ConnectError (AuthenticationError) if the listener
        refuses it."""
        route = self._routes(key)
        if route is None:
            return None
        address = route.address
        while True:
            with self._lock:
                if self._unreachable.get(address, 0.0) > time.monotonic():
                    return None
                idle = self._idle.get(address)
                sock = idle.pop() if idle else None
                if sock is None:
                    if self._open.get(address, 0) >= self.OPEN_PER_ADDRESS:
                        return None
                    self._open[address] = self._open.get(address, 0) + 1  # the one opened below
                    break
            if not select.select([sock], [], [], 0)[0]:
                return sock, route
            self._drop(address, sock)  # an idle connection that reads as ready was closed by its listener
        try:
            return connect(address, self._timeout, self._security, tls=route.tls, ticket=route.ticket), route
        except BaseException:
            with self._lock:
                self._open[address] -= 1
                self._unreachable[address] = time.monotonic() + self.UNREACHABLE_SECONDS
            raise

    def _drop(self, address: str, sock: socket.socket) -> None:
        sock.close()
        with self._lock:
            self._open[address] -= 1

    def request(self, connection: tuple[socket.socket, Route], header: dict,
                chunks: Iterable[bytes | memoryview]) -> Optional[str]:
        """Send on ``connection`` (from ``take``) a put frame of ``header`` whose pieces'
        bytes are ``chunks``, each written as it comes, and return the listener's answer:
        None once the array is stored, else why it was not. The connection is kept for the
        next request or closed. Raises WireError if the listener dropped the frame and said
        why (its bytes came too slowly), OSError naming the address if the connection failed
        otherwise, and whatever ``chunks`` raises (the listener then drops the frame, which
        never ends)."""
        sock, route = connection
        try:
            try:
                send_all(sock, frame(codec.pack({**header, "answer": True})))
                for chunk in chunks:
                    send_all(sock, chunk)
            except OSError as e:  # the listener may have said why it dropped the frame
                raise _dropped(sock) or peer_error(route.address, self._timeout, e) from None
            try:
                answer = _read_answer(sock, time.monotonic() + self._timeout)
            except OSError as e:
                raise peer_error(route.address, self._timeout, e) from None
        except BaseException:
            self._drop(route.address, sock)
            raise
        with self._lock:
            idle = self._idle.setdefault(route.address, [])
            keep = not (self._closed or answer.closing or len(idle) >= self.IDLE_PER_ADDRESS)
            if keep:
                idle.append(sock)
        if not keep:
            self._drop(route.address, sock)
        return answer.error

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for address, idle in self._idle.items():
                for sock in idle:
                    sock.close()
                self._open[address] -= len(idle)
            self._idle.clear()


def _dropped(sock: socket.socket) -> Optional[WireError]:
    """Why the listener dropped the frame being sent on ``sock`` (a WireError), if it
    answered before closing the connection (waited for ANSWER_GRACE_SECONDS at most; the
    connection is not used again)."""
    try:
        sock.settimeout(_ANSWER_GRACE_SECONDS)
        error = _read_answer(sock, time.monotonic() + _ANSWER_GRACE_SECONDS).error
    except (OSError, WireError):
        return None
    return WireError(f"the data listener dropped the array: {error}") if error else None


def _read_answer(sock: socket.socket, deadline: float) -> FrameAnswer:
    """The listener's answer to a put frame. ConnectionError if the connection ends first,
    WireError if the answer is not one."""
    head = bytearray(LENGTH.size)
    if recv_exactly(sock, memoryview(head), deadline):
        (n,) = LENGTH.unpack(head)
        if n > _MAX_ANSWER_BYTES:
            raise WireError(f"a put's answer of {n} bytes exceeds {_MAX_ANSWER_BYTES}")
        body = bytearray(n)
        if recv_exactly(sock, memoryview(body), deadline):
            return FrameAnswer.read(codec.unpack(bytes(body)))
    raise ConnectionError("the listener closed the connection before answering the put (its log says why)")


def probe(address: str, timeout: float, payload_bytes: int = 1 << 20, pings: int = 5,
          rounds: int = 2, security: Security | None = None,
          ticket: tuple[int, bytes] | None = None) -> tuple[float, float]:
    """Measure the link to the listener at ``address``: (latency in seconds, half the
    median round trip of ``pings`` empty probes; bandwidth in bytes per second, of the
    fastest of ``rounds`` transfers of ``payload_bytes``). Everything, connecting included,
    finishes within ``timeout`` seconds or raises OSError; a reply that is not a probe's
    raises WireError; a refused greeting ConnectError (``security``, ``ticket``: see
    ``connect``)."""
    if not 0 < payload_bytes <= MAX_PROBE_BYTES or pings < 1 or rounds < 1:
        raise ValueError(f"a probe needs 0 < payload_bytes <= {MAX_PROBE_BYTES}, pings >= 1 and rounds >= 1")
    deadline = time.monotonic() + timeout
    with connect(address, timeout, security, ticket=ticket) as sock:

        def exchange(nbytes: int, payload: bytes) -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"probing {address} took longer than {timeout:.1f} s")
            sock.settimeout(left)
            start = time.perf_counter()
            reply = Probe(nbytes).frame()  # the answer is the same frame, without the payload
            sock.sendall(reply)
            if payload:
                sock.sendall(payload)
            got = bytearray(len(reply))
            if not recv_exactly(sock, memoryview(got)):
                raise ConnectionError(f"{address} closed the connection during a probe")
            if got != reply:
                raise WireError(f"{address} answered a probe with something else")
            return time.perf_counter() - start

        trips = [exchange(0, b"") for _ in range(pings)]
        payload = bytes(payload_bytes)
        fastest = min(exchange(payload_bytes, payload) for _ in range(rounds))
    # A transfer's time includes a round trip; subtracting the quickest one seen, but never
    # more than half the transfer, keeps a busy moment during the pings from inflating it.
    return statistics.median(trips) / 2, payload_bytes / max(fastest - min(trips), fastest / 2)
