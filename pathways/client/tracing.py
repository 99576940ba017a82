"""Which ``@pw.program`` trace, if any, is running on this thread.

Compiled functions read it to record a call into the trace instead of running it;
programs set it while they trace. It lives apart from both so neither imports the other.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol


class Trace(Protocol):
    """A program being traced: it records a compiled function's call as a graph node."""

    def call(self, fn: Any, args: tuple) -> Any: ...


_local = threading.local()


def current_trace() -> Optional[Trace]:
    return getattr(_local, "trace", None)


@contextmanager
def tracing(trace: Trace) -> Iterator[None]:
    """Make ``trace`` this thread's current trace for the ``with`` block."""
    _local.trace = trace
    try:
        yield
    finally:
        _local.trace = None
