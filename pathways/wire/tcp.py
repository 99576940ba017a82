"""The bulk data plane: array bytes between workers over plain TCP, one connection per peer.

gRPC carries control and client traffic; worker-to-worker array bytes go here because
grpcio cannot send from a buffer without copying it into a message and its receiver
cannot read into a preallocated array: measured on the development machine, the best
grpcio stream moved 0.56-0.68x of a raw socket's bytes per second, and 0.2x inside the
cluster (BENCHMARKS.md). Here a sender writes each piece straight from the array's memory,
and the receiver reads it straight into a 64-byte-aligned array that JAX adopts without
another copy.

A frame is a 4-byte big-endian length, a msgpack put header (codec.pieces_header fields
plus handle, layout and sender count), then the raw bytes of each piece in order. Frames
are fire and forget: a receiver that refuses one logs why. A malformed frame closes its
connection (the stream cannot be resynchronized); the sender reconnects for the next one.

A probe frame (header ``{"t": "probe", "bytes": n}`` followed by n bytes, n at most
MAX_PROBE_BYTES) is the one frame that is answered: the listener reads the bytes and
replies on the same connection with a frame of header ``{"t": "probe", "bytes": n}`` and no
payload. ``probe`` uses it to measure a link's latency and bandwidth on its own connection,
so that it never shares a socket with array traffic.
"""

from __future__ import annotations

import logging
import math
import socket
import statistics
import struct
import threading
import time
from typing import Callable, Optional

import numpy as np

from pathways.errors import WireError
from pathways.wire import codec

log = logging.getLogger("pathways.wire")

_LENGTH = struct.Struct("!I")
_MAX_HEADER_BYTES = 16 * 1024 * 1024
_COALESCE_BYTES = 64 * 1024  # pieces up to this size are copied into the frame's one write
_ALIGN = 64  # XLA's CPU client adopts host buffers aligned like this instead of copying them
MAX_PROBE_BYTES = 8 * 1024 * 1024
_PROBE_CHUNK = 1 << 20  # probe payloads are read into a scratch buffer this large, and discarded

# receive(header, pieces) stores one sender's part of an array; returns an error or None
Receive = Callable[[dict, list], Optional[str]]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed the connection first."""
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class Listener:
    """Accepts peers' connections on a loopback port and hands every frame to ``receive``."""

    def __init__(self, receive: Receive, timeout: float, host: str = "127.0.0.1") -> None:
        self._receive = receive
        self._timeout = timeout
        self._server = socket.create_server((host, 0))
        self.address = f"tcp://{host}:{self._server.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="pathways-data-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="pathways-data-in", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    if not self._frame(conn):
                        return
                except (WireError, ValueError, MemoryError) as e:
                    log.error("closing a data connection after a malformed frame: %s: %s", type(e).__name__, e)
                    return
                except OSError:
                    return

    def _frame(self, conn: socket.socket) -> bool:
        length = bytearray(_LENGTH.size)
        conn.settimeout(None)  # between frames a peer may stay quiet for as long as it likes
        if not _recv_exactly(conn, memoryview(length)):
            return False
        conn.settimeout(self._timeout)  # within a frame it may not
        (n,) = _LENGTH.unpack(length)
        if n > _MAX_HEADER_BYTES:
            raise WireError(f"a data frame header of {n} bytes exceeds {_MAX_HEADER_BYTES}")
        raw = bytearray(n)
        if not _recv_exactly(conn, memoryview(raw)):
            return False
        header = codec.unpack(bytes(raw))
        if not isinstance(header, dict):
            raise WireError("a data frame header must be a map")
        if header.get("t") == "probe":
            return self._answer_probe(conn, header)
        pieces = []
        if "poison" not in header:
            dtype, _, specs = codec.piece_specs(header)
            for index, shape in specs:
                array = aligned_empty(shape, dtype)
                if array.nbytes and not _recv_exactly(conn, memoryview(array.reshape(-1).view(np.uint8))):
                    return False
                pieces.append((index, array))
        error = self._receive(header, pieces)
        if error:
            log.error("refused an array from a peer: %s", error)
        return True

    def _answer_probe(self, conn: socket.socket, header: dict) -> bool:
        n = header.get("bytes")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PROBE_BYTES:
            raise WireError(f"a probe carries 0 to {MAX_PROBE_BYTES} bytes, its header says {n!r}")
        scratch = memoryview(bytearray(min(n, _PROBE_CHUNK)))
        while n:
            step = min(n, len(scratch))
            if not _recv_exactly(conn, scratch[:step]):
                return False
            n -= step
        conn.sendall(_probe_frame(header["bytes"]))
        return True

    def close(self) -> None:
        self._closed = True
        try:
            # wakes the accepting thread; a plain close leaves the port listening while it waits
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()


class Links:
    """Connections to peers' listeners, opened on first use and reopened after a failure."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._links: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self._lock = threading.Lock()

    def send(self, address: str, header: dict, pieces: list) -> None:
        """Send one frame; raises OSError if the peer cannot be reached."""
        frame = codec.pack(header)
        frame = _LENGTH.pack(len(frame)) + frame
        arrays = [np.ascontiguousarray(array) for _, array in pieces]
        if sum(a.nbytes for a in arrays) <= _COALESCE_BYTES:  # one write, one wakeup of the receiver
            frame += b"".join(a.tobytes() for a in arrays)
            arrays = []
        sock, lock = self._link(address)
        with lock:
            try:
                sock.sendall(frame)
                for data in arrays:
                    if data.nbytes:
                        sock.sendall(memoryview(data.reshape(-1).view(np.uint8)))
            except OSError:
                self._drop(address, sock)
                raise

    def _link(self, address: str) -> tuple[socket.socket, threading.Lock]:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                host, _, port = address.removeprefix("tcp://").rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=self._timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                link = self._links[address] = (sock, threading.Lock())
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


def _probe_frame(nbytes: int) -> bytes:
    body = codec.pack({"t": "probe", "bytes": nbytes})
    return _LENGTH.pack(len(body)) + body


def probe(address: str, timeout: float, payload_bytes: int = 1 << 20, pings: int = 5,
          rounds: int = 2) -> tuple[float, float]:
    """Measure the link to the listener at ``address``: (latency in seconds, half the
    median round trip of ``pings`` empty probes; bandwidth in bytes per second, of the
    fastest of ``rounds`` transfers of ``payload_bytes``). Everything, connecting included,
    finishes within ``timeout`` seconds or raises OSError; a reply that is not a probe's
    raises WireError."""
    if not 0 < payload_bytes <= MAX_PROBE_BYTES or pings < 1 or rounds < 1:
        raise ValueError(f"a probe needs 0 < payload_bytes <= {MAX_PROBE_BYTES}, pings >= 1 and rounds >= 1")
    deadline = time.monotonic() + timeout
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def exchange(nbytes: int, payload: bytes) -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"probing {address} took longer than {timeout:.1f} s")
            sock.settimeout(left)
            start = time.perf_counter()
            reply = _probe_frame(nbytes)  # the answer is the same frame, without the payload
            sock.sendall(reply)
            if payload:
                sock.sendall(payload)
            got = bytearray(len(reply))
            if not _recv_exactly(sock, memoryview(got)):
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
