"""Handle numbering. A handle is a 64-bit integer: the owning session in the high bits.

The controller owns session 0 and numbers transfer copies from it, so every client's
handles and the controller's never collide, and a session's buffers can be found by prefix.
"""

from __future__ import annotations

SESSION_SHIFT = 40
COUNTER_MASK = (1 << SESSION_SHIFT) - 1
MAX_SESSION = (1 << 23) - 1


def session_of(handle: int) -> int:
    return handle >> SESSION_SHIFT


def first_handle(session: int) -> int:
    return session << SESSION_SHIFT
