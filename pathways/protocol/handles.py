"""Handle arithmetic, in one place. A handle is a 64-bit integer naming one array (or a
client's function or program): the owning session in the high bits, a counter below.

The controller owns session 0 and numbers transfer copies from it, so every client's
handles and the controller's never collide, and a session's buffers can be found by
prefix. A run of a program numbers its values from a base the client chose (``base + v``)
and its transfer copies from one the controller chose (``tbase + copy``).

Handles need not be unguessable, and are not: they are counters, and anyone can work out
another session's. Knowing one grants nothing. The controller refuses every message of a
session that names a handle of another session (a Run binding it as an input, a
PutNotice, a Delete), and a worker serves a put or fetch of a handle only to a caller
presenting the credential of the handle's session (``session_of``): a secret the
controller draws per session and gives to that session's client and to the workers. The
controller's session 0 has no credential, so its transfer copies are never served to
clients.
"""

from __future__ import annotations

from typing import Mapping

SESSION_SHIFT = 40
COUNTER_MASK = (1 << SESSION_SHIFT) - 1
MAX_SESSION = (1 << 23) - 1
MAX_HANDLE = ((MAX_SESSION + 1) << SESSION_SHIFT) - 1


def session_of(handle: int) -> int:
    return handle >> SESSION_SHIFT


def first_handle(session: int) -> int:
    return session << SESSION_SHIFT


def fits(base: int, count: int) -> bool:
    """Whether ``count`` consecutive handles from ``base`` stay in base's session."""
    return (base & COUNTER_MASK) + count <= COUNTER_MASK


def value_handle(v: int, base: int, tbase: int, nvalues: int, args: Mapping[int, int]) -> int:
    """The handle of register ``v`` of a run: a bound input's own handle, a program value
    ``base + v``, or transfer copy ``v - nvalues`` from ``tbase``."""
    h = args.get(v)
    if h is None:
        h = base + v if v < nvalues else tbase + v - nvalues
    return h
