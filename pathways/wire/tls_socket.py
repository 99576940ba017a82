"""A TLS socket shared by a reader thread and a writer thread.

OpenSSL's connection object must not be used by two threads at once, and Python's
``ssl.SSLSocket`` does nothing to prevent it: a thread blocked in ``recv`` and another in
``sendall`` on the same socket call into it together. Measured on the development machine
(one thread reading frames while another writes them, the peer an asyncio TLS server), the
stream broke within a second in most runs: the reader saw a clean end that no one sent,
or OpenSSL failed with "internal error" and the peer with "bad record mac". A worker's
stream to its controller is such a pair of threads.

``SharedTlsSocket`` makes every call into OpenSSL under one lock, with the socket in
non-blocking mode, and waits for the socket (``select``) outside the lock, so that a reader
waiting for data never holds up a writer. A wait looks again every ``RECHECK_SECONDS``, in
case the other thread's call took in the bytes it waits for. Each call gives up with
TimeoutError once ``timeout`` seconds pass without progress, as a socket's own timeout does;
with no timeout it waits until the connection ends (a worker's stream: its watchdog shuts
the socket down once it judges the controller lost, which ends the wait).
"""

from __future__ import annotations

import io
import select
import ssl
import threading
import time
from typing import Any

RECHECK_SECONDS = 0.05


class SharedTlsSocket(io.RawIOBase):
    """``sock`` (connected, handshake done) for one reading and one writing thread: a raw
    stream to read from (wrap it in ``io.BufferedReader``) and ``sendall``."""

    def __init__(self, sock: ssl.SSLSocket, timeout: float | None) -> None:
        super().__init__()
        sock.setblocking(False)
        self._sock = sock
        self._timeout = timeout
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        """From now on reads find the end of the stream (call it before shutting the socket
        down: a shut down ``SSLSocket`` reads the raw bytes of TLS records)."""
        with self._lock:
            super().close()

    def readinto(self, buffer: Any) -> int:
        """Up to ``len(buffer)`` bytes into ``buffer``; 0 at the end of the stream."""
        deadline = self._deadline()
        while True:
            with self._lock:
                if self.closed:  # the socket may be shut down: what it reads now is not TLS's
                    return 0
                try:
                    return self._sock.recv_into(buffer)
                except ssl.SSLWantReadError:
                    writing = False
                except ssl.SSLWantWriteError:
                    writing = True
            self._wait(writing, deadline, "no bytes arrived")

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        deadline = self._deadline()
        while view:
            with self._lock:
                try:
                    sent = self._sock.send(view)
                except ssl.SSLWantWriteError:
                    writing = True
                except ssl.SSLWantReadError:
                    writing = False
                else:
                    view = view[sent:]
                    deadline = self._deadline()
                    continue
            self._wait(writing, deadline, "the peer took no bytes")

    def _deadline(self) -> float | None:
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _wait(self, writing: bool, deadline: float | None, what: str) -> None:
        left = RECHECK_SECONDS if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} for {self._timeout:g} s")
        ready = ([], [self._sock]) if writing else ([self._sock], [])
        select.select(*ready, [], min(left, RECHECK_SECONDS))
