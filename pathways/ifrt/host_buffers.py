"""One IFRT session's host buffers: bytes the client stored for a put, or the server
stored for a read, keyed by the client's handle.

A buffer is the chunks that arrived for it, in order, kept as they came (no copy into
a buffer of their own): a client's ``HostBufferStore`` adds the chunks of its messages,
a read from the workers the chunks of the worker's reply. Whoever uses a buffer may
read its chunks while they still arrive (``chunks``: a put forwards them to the worker,
a lookup to the client, each chunk as it comes), or wait for all of them as one
contiguous array (``get``).

Bounded: at most ``limit`` bytes per session at once (a store or read beyond it is
refused with RESOURCE_EXHAUSTED, naming the limit); an array that its buffers hold only in
part (strided: a buffer of 4 bytes with byte strides 0 may stand for gigabytes) counts at
its full size (``admit``). Every wait is bounded: for a
buffer not opened yet (the client's ``HostBufferStore`` call and the request that uses
it travel on different streams) and for its next chunk. A buffer's bytes must keep the
minimum pace (wire/pace.py): a client that trickles them, holding the workers' receive
budget and this session's bytes while a put forwards them, has its buffer failed with
DEADLINE_EXCEEDED within a pace window, by the next chunk it sends or by the reader
waiting for that chunk, and its ``HostBufferStore`` call ended (``cancel``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Optional, Union

import numpy as np

from pathways.ifrt.types import (DEADLINE_EXCEEDED, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE,
                                 IfrtError)
from pathways.wire.pace import Pace, TooSlow

DEFAULT_LIMIT = 8 << 30
_PACE_SLACK = 0.05  # seconds a reader waits past a pace window's end, so that the window has ended when it looks

Chunk = Union[bytes, memoryview]


class HostBuffer:
    """The chunks of one host buffer so far; ``size``: the bytes announced (None: not
    known until the last chunk); ``pace``: the minimum pace of a client's bytes (None for
    bytes the server reads from workers, which may compute a long while first);
    ``cancel``: ends the call that stores it, if its bytes fall behind."""

    __slots__ = ("handle", "size", "chunks", "received", "reserved", "done", "error", "pace", "cancel")

    def __init__(self, handle: int, size: Optional[int], pace: Optional[Pace] = None,
                 cancel: Optional[Callable[[], None]] = None) -> None:
        self.handle = handle
        self.size = size
        self.chunks: list[Chunk] = []
        self.received = 0
        self.reserved = 0  # bytes of the session's limit this buffer holds
        self.done = False
        self.error: Optional[IfrtError] = None
        self.pace = pace
        self.cancel = cancel


class HostBuffers:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._buffers: dict[int, HostBuffer] = {}
        self._reserved = 0
        self._cond = threading.Condition()
        self._closed: Optional[str] = None

    @property
    def used(self) -> int:
        return self._reserved

    # ---- filling a buffer ------------------------------------------------------------

    def open(self, handle: int, size: Optional[int], cancel: Optional[Callable[[], None]] = None) -> HostBuffer:
        """A new buffer ``handle`` of ``size`` bytes (None: unannounced), empty; its bytes
        come by ``add``, then ``finish`` (or ``fail``). With ``cancel`` (a client's
        ``HostBufferStore``: it ends that call) its bytes must keep the minimum pace."""
        if size is not None and size < 0:
            raise IfrtError(INVALID_ARGUMENT, f"host buffer size {size} is negative")
        pace = None if cancel is None else Pace(f"host buffer {handle}", size)
        buffer = HostBuffer(handle, size, pace, cancel)
        with self._cond:
            self._check_open()
            if handle in self._buffers:
                raise IfrtError(INVALID_ARGUMENT, f"host buffer {handle} is already stored; delete it first")
            if size:
                self._take(buffer, size)
            self._buffers[handle] = buffer
            self._cond.notify_all()
        return buffer

    def add(self, buffer: HostBuffer, chunk: Chunk) -> None:
        """The next chunk of ``buffer`` (kept as it is: the caller does not change it);
        dropped when the buffer failed or its reader gave it up. DEADLINE_EXCEEDED when
        the buffer's bytes came too slowly."""
        n = memoryview(chunk).nbytes
        with self._cond:
            self._check_open()
            if buffer.error is not None:
                if buffer.error.code == DEADLINE_EXCEEDED:
                    raise buffer.error
                return
            if buffer.size is not None and buffer.received + n > buffer.size:
                raise IfrtError(INVALID_ARGUMENT, (
                    f"host buffer {buffer.handle} got more than the {buffer.size} bytes announced"))
            self._keep_pace(buffer, n, by_reader=False)
            if buffer.size is None:
                self._take(buffer, n)
            buffer.chunks.append(chunk)
            buffer.received += n
            self._cond.notify_all()

    def finish(self, buffer: HostBuffer) -> None:
        with self._cond:
            if buffer.error is not None:
                return
            if buffer.size is not None and buffer.received != buffer.size:
                raise IfrtError(INVALID_ARGUMENT, (
                    f"host buffer {buffer.handle} got {buffer.received} bytes of the {buffer.size} announced"))
            buffer.done = True
            self._cond.notify_all()

    def fail(self, buffer: HostBuffer, error: IfrtError) -> None:
        """``buffer`` will not be whole: whoever reads it gets ``error``; its bytes are freed."""
        with self._cond:
            self._fail_locked(buffer, error)

    def _fail_locked(self, buffer: HostBuffer, error: IfrtError) -> None:
        if buffer.error is None:  # the first cause is the one its readers hear
            buffer.error = error
        buffer.chunks = []
        self._give_back(buffer)
        self._cond.notify_all()

    def check_pace(self) -> None:
        """Fail the client's buffers whose bytes fell behind the minimum pace, ending their
        stores: a client that stops sending in the middle of a store, with nobody reading the
        buffer yet, holds a server thread for a pace window at most."""
        with self._cond:
            for buffer in list(self._buffers.values()):
                if buffer.pace is not None and not buffer.done and buffer.error is None:
                    try:
                        self._keep_pace(buffer, 0, by_reader=True)
                    except IfrtError:
                        pass  # failed, and its store ended: its reader, if one comes, hears why

    def _keep_pace(self, buffer: HostBuffer, n: int, by_reader: bool) -> None:
        """Count ``n`` bytes of ``buffer`` in (none: just look at the clock); a buffer that
        fell behind the minimum pace fails. Its reader, which found it so while the client
        sent nothing, ends the call storing it, which waits for the client's next message;
        that call itself, on a message, ends with the error raised here."""
        if buffer.pace is None:
            return
        try:
            buffer.pace.arrived(n)
        except TooSlow as e:
            self._fail_locked(buffer, IfrtError(DEADLINE_EXCEEDED, str(e)))
            if by_reader and buffer.cancel is not None:
                buffer.cancel()
            raise buffer.error from None

    def store(self, handle: int, value: np.ndarray) -> None:
        """Keep ``value`` (its bytes, not copied when contiguous) as the whole of buffer ``handle``."""
        buffer = self.open(handle, value.nbytes)
        self.add(buffer, memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
        self.finish(buffer)

    def admit(self, size: int, what: str) -> None:
        """Refuse (RESOURCE_EXHAUSTED, naming ``size`` and the limit) to make ``what``, an
        array of ``size`` bytes that the session's own host buffers hold only in part (a
        strided buffer laid out in C order as it is sent, shards assembled here), where a
        contiguous host buffer of it would not fit beside the bytes stored now: a request
        of a few bytes is bounded by the bytes it stands for."""
        with self._cond:
            self._check_open()
            if self._reserved + size > self.limit:
                raise IfrtError(RESOURCE_EXHAUSTED, (
                    f"{what} is {size} bytes, more than this session's bound of {self.limit} bytes of host "
                    f"buffers ({self._reserved} in use) allows; send a smaller array, or split it into arrays "
                    "put one after another"))

    def _take(self, buffer: HostBuffer, size: int) -> None:
        if self._reserved + size > self.limit:
            raise IfrtError(RESOURCE_EXHAUSTED, (
                f"storing {size} more bytes would exceed this session's {self.limit} bytes of host buffers "
                f"({self._reserved} in use); read or delete arrays sooner, or move smaller arrays"))
        self._reserved += size
        buffer.reserved += size

    def _give_back(self, buffer: HostBuffer) -> None:
        self._reserved -= buffer.reserved
        buffer.reserved = 0

    # ---- reading a buffer --------------------------------------------------------------

    def chunks(self, handle: int, timeout: float, take: bool = False,
               open_timeout: Optional[float] = None) -> Iterator[Chunk]:
        """The chunks of buffer ``handle`` as they arrive, to the last; waits up to
        ``open_timeout`` seconds (default ``timeout``) for the buffer to be opened and up to
        ``timeout`` for each next chunk. ``take``: the buffer is the reader's alone, deleted
        once read (or given up)."""
        buffer = self._wait(handle, timeout if open_timeout is None else open_timeout, lambda b: True, take)
        i = 0
        try:
            while True:
                with self._cond:
                    deadline = time.monotonic() + timeout
                    while not (i < len(buffer.chunks) or buffer.done or buffer.error is not None):
                        self._check_open()
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise IfrtError(UNAVAILABLE, f"host buffer {handle} got no more bytes within {timeout:g} "
                                                         f"s ({buffer.received} arrived)")
                        if buffer.pace is None:
                            self._cond.wait(left)
                        else:
                            self._cond.wait(min(left, buffer.pace.seconds_left() + _PACE_SLACK))
                            if buffer.error is None and not buffer.done:
                                self._keep_pace(buffer, 0, by_reader=True)
                    if buffer.error is not None:
                        raise buffer.error
                    if i == len(buffer.chunks):
                        return
                    chunk = buffer.chunks[i]
                    if take:  # sent on: not kept here
                        buffer.chunks[i] = b""
                i += 1
                yield chunk
        finally:
            if take:  # read to the end, or given up: what still comes is dropped
                with self._cond:
                    if buffer.error is None:
                        buffer.error = IfrtError(UNAVAILABLE, f"host buffer {handle} was read already")
                    buffer.chunks = []
                    self._give_back(buffer)

    def get(self, handle: int, timeout: float, take: bool = False) -> np.ndarray:
        """Buffer ``handle`` whole, as flat uint8 (read-only), waiting up to ``timeout``
        seconds for it to be opened and filled. ``take``: deleted from the session, the
        caller keeps the bytes alive as long as it needs them."""
        buffer = self._wait(handle, timeout, lambda b: b.done, take)
        with self._cond:
            if buffer.error is not None:
                raise buffer.error
            chunks = buffer.chunks
        whole = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        with self._cond:
            if buffer.error is not None:  # closed meanwhile
                raise buffer.error
            buffer.chunks = [whole]  # one contiguous chunk from now on
            if take:
                self._give_back(buffer)
        return np.frombuffer(whole, np.uint8)

    def _wait(self, handle: int, timeout: float, ready: Callable[[HostBuffer], bool], take: bool) -> HostBuffer:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                buffer = self._buffers.get(handle)
                if buffer is not None and (ready(buffer) or buffer.error is not None):
                    if take:
                        del self._buffers[handle]
                    return buffer
                left = deadline - time.monotonic()
                if left <= 0:
                    if buffer is None:
                        raise IfrtError(NOT_FOUND, f"host buffer {handle} was not stored within {timeout:g} s")
                    raise IfrtError(UNAVAILABLE, f"host buffer {handle} was not whole within {timeout:g} s "
                                                 f"({buffer.received} bytes arrived)")
                self._cond.wait(left)

    def delete(self, handle: int) -> bool:
        """Forget buffer ``handle``; what still arrives for it (a read from the workers in
        flight) is dropped, not counted against the session's bound."""
        with self._cond:
            buffer = self._buffers.pop(handle, None)
            if buffer is None:
                return False
            self._fail_locked(buffer, IfrtError(NOT_FOUND, f"host buffer {handle} was deleted"))
            return True

    def close(self, reason: str) -> None:
        with self._cond:
            self._closed = reason
            for buffer in self._buffers.values():
                buffer.error = IfrtError(UNAVAILABLE, reason)
                buffer.chunks = []
            self._buffers.clear()
            self._reserved = 0
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise IfrtError(UNAVAILABLE, self._closed)
