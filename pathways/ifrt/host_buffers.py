"""One IFRT session's host buffers: bytes the client stored for a put, or the server
stored for a read, keyed by the client's handle.

Bounded: at most ``limit`` bytes per session at once (a store or copy beyond it is
refused with RESOURCE_EXHAUSTED, naming the limit). Lookups of a handle not stored yet
wait, bounded, since the client's HostBufferStore call and the request that uses it
travel on different streams.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from pathways.ifrt.types import IfrtError, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE

DEFAULT_LIMIT = 8 << 30


class HostBuffers:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._buffers: dict[int, np.ndarray] = {}  # flat uint8
        self._reserved = 0
        self._cond = threading.Condition()
        self._closed: Optional[str] = None

    @property
    def used(self) -> int:
        return self._reserved

    def allocate(self, handle: int, size: int) -> np.ndarray:
        """Room for ``size`` bytes the client is about to store as ``handle``; hand it to
        ``commit`` once filled, or ``release`` it."""
        if size < 0:
            raise IfrtError(INVALID_ARGUMENT, f"host buffer size {size} is negative")
        with self._cond:
            self._check_open()
            if handle in self._buffers:
                raise IfrtError(INVALID_ARGUMENT, f"host buffer {handle} is already stored; delete it first")
            self._take(size)
        try:
            return np.empty(size, np.uint8)
        except (MemoryError, ValueError):
            self.release(size)
            raise IfrtError(RESOURCE_EXHAUSTED, f"cannot allocate {size} bytes for host buffer {handle}") from None

    def release(self, size: int) -> None:
        with self._cond:
            self._reserved -= size

    def commit(self, handle: int, buffer: np.ndarray) -> None:
        """Store an allocated buffer (its bytes were reserved by ``allocate``)."""
        with self._cond:
            if self._closed is not None or handle in self._buffers:
                self._reserved -= buffer.nbytes
                self._check_open()
                raise IfrtError(INVALID_ARGUMENT, f"host buffer {handle} is already stored; delete it first")
            self._buffers[handle] = buffer
            self._cond.notify_all()

    def store(self, handle: int, buffer: np.ndarray) -> None:
        """Keep ``buffer`` (flat uint8, not copied) as ``handle``: the server's own bytes."""
        with self._cond:
            self._check_open()
            if handle in self._buffers:
                raise IfrtError(INVALID_ARGUMENT, f"host buffer {handle} is already stored; delete it first")
            self._take(buffer.nbytes)
            self._buffers[handle] = buffer
            self._cond.notify_all()

    def _take(self, size: int) -> None:
        if self._reserved + size > self.limit:
            raise IfrtError(RESOURCE_EXHAUSTED, (
                f"storing {size} more bytes would exceed this session's {self.limit} bytes of host buffers "
                f"({self._reserved} in use); read or delete arrays sooner, or move smaller arrays"))
        self._reserved += size

    def get(self, handle: int, timeout: float) -> np.ndarray:
        """The buffer stored as ``handle``, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                buffer = self._buffers.get(handle)
                if buffer is not None:
                    return buffer
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IfrtError(NOT_FOUND, f"host buffer {handle} was not stored within {timeout:g} s")
                self._cond.wait(left)

    def delete(self, handle: int) -> bool:
        with self._cond:
            buffer = self._buffers.pop(handle, None)
            if buffer is None:
                return False
            self._reserved -= buffer.nbytes
            return True

    def close(self, reason: str) -> None:
        with self._cond:
            self._closed = reason
            self._buffers.clear()
            self._reserved = 0
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise IfrtError(UNAVAILABLE, self._closed)
