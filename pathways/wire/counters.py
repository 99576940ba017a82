"""Counts of the array bytes a process moved to or from another: what a status shows and
a test asserts on (that a checkpoint's bytes never passed through the controller, say)."""

from __future__ import annotations

import threading


class ByteCounter:
    """Bytes sent and bytes received, added to by whichever threads move them; they only
    ever grow."""

    __slots__ = ("_lock", "sent", "received")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # ``+=`` on an attribute is not atomic between threads
        self.sent = 0
        self.received = 0

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self.sent += nbytes

    def add_received(self, nbytes: int) -> None:
        with self._lock:
            self.received += nbytes

    def __repr__(self) -> str:
        return f"ByteCounter(sent={self.sent}, received={self.received})"
