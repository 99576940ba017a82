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

from typing import Any, Generic, Iterable, Mapping, TypeVar

SESSION_SHIFT = 40
COUNTER_MASK = (1 << SESSION_SHIFT) - 1
MAX_SESSION = (1 << 23) - 1
MAX_HANDLE = ((MAX_SESSION + 1) << SESSION_SHIFT) - 1

V = TypeVar("V")


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


class HeldReleases(Generic[V]):
    """Counts the reads in flight of each handle, and holds back the release of a handle
    still being read until its last read ends: a delete must not free a buffer that a
    queued run (the controller) or a fetch (the IFRT proxy) is about to read. Not locked:
    its owner serializes the calls."""

    def __init__(self) -> None:
        self._reads: dict[int, int] = {}  # handle -> reads in flight
        self._held: dict[int, V] = {}  # released while read: what to free once the reads end

    def reading(self, handles: Iterable[int]) -> None:
        """A read of each of ``handles`` begins (a handle named twice is read twice)."""
        for h in handles:
            self._reads[h] = self._reads.get(h, 0) + 1

    def release(self, handle: int, value: V) -> bool:
        """``handle`` is no longer needed: True when nothing reads it (free ``value`` now),
        else False, and ``value`` comes back from ``read_done`` once the last read ends."""
        if self._reads.get(handle):
            self._held[handle] = value
            return False
        return True

    def read_done(self, handles: Iterable[int]) -> dict[int, V]:
        """A read of each of ``handles`` ended; returns the releases it held back."""
        ready: dict[int, V] = {}
        for h in handles:
            left = self._reads.get(h, 0) - 1
            if left > 0:
                self._reads[h] = left
                continue
            self._reads.pop(h, None)
            if h in self._held:
                ready[h] = self._held.pop(h)
        return ready


def discard(table: dict[int, set], handle: int, member: Any) -> None:
    """Take ``member`` out of ``handle``'s set in ``table`` (those waiting on or reading a
    handle), and the handle out of ``table`` once its set is empty."""
    members = table.get(handle)
    if members is not None:
        members.discard(member)
        if not members:
            del table[handle]
