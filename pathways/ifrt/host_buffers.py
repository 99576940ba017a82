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
it travel on different streams) and for its next chunk.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Optional, Union

import numpy as np

from pathways.ifrt.types import IfrtError, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE

DEFAULT_LIMIT = 8 << 30

Chunk = Union[bytes, memoryview]


class HostBuffer:
    """The chunks of one host buffer so far; ``size``: the bytes announced (None: not
    known until the last chunk)."""

    __slots__ = ("handle", "size", "chunks", "received", "reserved", "done", "error")

    def __init__(self, handle: int, size: Optional[int]) -> None:
        self.handle = handle
        self.size = size
        self.chunks: list[Chunk] = []
        self.received = 0
        self.reserved = 0  # bytes of the session's limit this buffer holds
        self.done = False
        self.error: Optional[IfrtError] = None


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

    def open(self, handle: int, size: Optional[int]) -> HostBuffer:
        """A new buffer ``handle`` of ``size`` bytes (None: unannounced), empty; its bytes
        come by ``add``, then ``finish`` (or ``fail``)."""
        if size is not None and size < 0:
            raise IfrtError(INVALID_ARGUMENT, f"host buffer size {size} is negative")
        buffer = HostBuffer(handle, size)
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
        dropped when the buffer failed or its reader gave it up."""
        n = memoryview(chunk).nbytes
        with self._cond:
            self._check_open()
            if buffer.error is not None:
                return
            if buffer.size is not None and buffer.received + n > buffer.size:
                raise IfrtError(INVALID_ARGUMENT, (
                    f"host buffer {buffer.handle} got more than the {buffer.size} bytes announced"))
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
            buffer.error = error
            buffer.chunks = []
            self._give_back(buffer)
            self._cond.notify_all()

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
                        self._cond.wait(left)
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
        with self._cond:
            buffer = self._buffers.pop(handle, None)
            if buffer is None:
                return False
            self._give_back(buffer)
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
