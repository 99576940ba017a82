"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes.

The data plane (tcp.py) frames its put headers this way, and the controller-worker stream
carries control batches (``encode_batch`` payloads, exactly what a gRPC stream would carry)
this way: measured on the development machine, a framed control message costs about a
fifth of the CPU of one over grpc.aio (BENCHMARKS.md, "Control messages"). The controller reads with
asyncio (``read_frame``); a worker reads and writes from threads (``FrameReader``,
``frame``).
"""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import time
from typing import Callable

from pathways.errors import WireError

LENGTH = struct.Struct("!I")
_BODY_PIECE = 1 << 20  # a large frame's body is read in pieces this large, each a sign of life


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front, ready for one ``sendall``."""
    return LENGTH.pack(len(payload)) + payload


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed the connection first. Past
    ``deadline`` (time.monotonic()) raises WireError."""
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
        if deadline is not None and view and time.monotonic() > deadline:
            raise WireError(f"a frame did not arrive before its deadline ({len(view)} bytes were still missing)")
    return True


def _check_length(n: int, limit: int) -> None:
    if n > limit:
        raise WireError(f"a frame of {n} bytes exceeds the {limit} bytes allowed here")


class FrameReader:
    """Reads frames from a blocking socket through a buffer, so that one ``recv`` may
    bring several small frames."""

    def __init__(self, source: socket.socket | io.RawIOBase) -> None:
        """``source``: a blocking socket, or a raw stream (a ``tls_socket.SharedTlsSocket``)."""
        self._file = source.makefile("rb") if isinstance(source, socket.socket) else io.BufferedReader(source)

    def read(self, limit: int) -> bytes | None:
        """The next frame's payload; None at a clean end (the peer closed between frames).
        A frame longer than ``limit``, or one cut short, raises WireError."""
        head = self._file.read(LENGTH.size)
        if not head:
            return None
        if len(head) < LENGTH.size:
            raise WireError("the connection ended inside a frame's length")
        (n,) = LENGTH.unpack(head)
        _check_length(n, limit)
        payload = self._file.read(n)
        if len(payload) < n:
            raise WireError(f"the connection ended inside a frame ({len(payload)} of {n} bytes arrived)")
        return payload

    def close(self) -> None:
        self._file.close()


async def read_frame(reader: asyncio.StreamReader, limit: int, seconds: float,
                     heard: Callable[[], None] | None = None) -> bytes | None:
    """The next frame's payload; None at a clean end (EOF between frames). Between frames
    the peer may stay quiet as long as it likes (its liveness is the caller's business:
    ``heard`` is called whenever bytes of a frame arrive); once a frame's length has
    arrived, the frame must be at most ``limit`` bytes and complete within ``seconds``,
    else WireError (the stream cannot be resynchronized: the caller closes the connection)."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise WireError("the connection ended inside a frame's length") from None
    (n,) = LENGTH.unpack(head)
    _check_length(n, limit)
    if heard is not None:
        heard()
    try:
        body = reader.readexactly(n) if heard is None else _read_body(reader, n, heard)
        return await asyncio.wait_for(body, seconds)
    except asyncio.IncompleteReadError as e:
        raise WireError(f"the connection ended inside a frame ({len(e.partial)} of {n} bytes arrived)") from None
    except asyncio.TimeoutError:
        raise WireError(f"a frame of {n} bytes did not complete within {seconds:g} s") from None


async def _read_body(reader: asyncio.StreamReader, n: int, heard: Callable[[], None]) -> bytes:
    """``n`` bytes, calling ``heard`` as each piece arrives: a large frame on a slow link
    is a peer that talks, not a silent one."""
    if n == 0:
        return b""
    piece = await reader.read(min(n, _BODY_PIECE))
    if len(piece) == n:  # the whole frame had arrived (the common case): no copy
        return piece
    body = bytearray(piece)
    while piece:
        heard()
        if len(body) == n:
            return bytes(body)
        piece = await reader.read(min(n - len(body), _BODY_PIECE))
        body += piece
    raise asyncio.IncompleteReadError(bytes(body), n)


async def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Send one frame and wait until the transport has room again (backpressure: a peer
    that stops reading stops its writer here, not the controller's memory)."""
    writer.write(frame(payload))
    await writer.drain()
