"""Threads that belong to an owner: started through it, joined by it when it closes.

An object that runs threads of its own (a data-plane listener and its connections, a
client session's reader and its streamed puts, the IFRT front end's sessions) keeps them in
a ``Threads``. Its ``close`` first ends what they wait on (a socket, a stream, a queue), then
``join``s them within a bound, so that nothing it started outlives it unnoticed: a thread
still running then is named in the log. They stay daemon threads, so that one stuck in a
library call cannot keep the process from exiting. Threads that live as long as their
process (a keeper's parent watch, the worker's early import) are started plainly, and say
so where they start.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("pathways")

JOIN_SECONDS = 5.0  # what an owner's close waits, in all, for its threads to end


class Threads:
    """The threads of one owner (``owner`` names it in the log)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
        """Start ``target(*args)`` on a new daemon thread called ``name``; raises what
        Thread.start raises (RuntimeError when no thread can start)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        with self._lock:  # kept once started: a thread not started yet would look ended
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        return thread

    def running(self) -> int:
        """How many of them have not ended."""
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def join(self, timeout: float = JOIN_SECONDS) -> list[str]:
        """Wait up to ``timeout`` seconds in all for every thread but the calling one to end;
        the names of those still running then (logged)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
        if left:
            log.warning("%s closed with %d thread(s) still running after %.1f s: %s", self._owner, len(left),
                        timeout, ", ".join(sorted(set(left))))
        return left
