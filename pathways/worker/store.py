"""The object store: handles -> arrays (or the error that poisoned them).

Values arrive from the executor, from clients' puts and from peers' pushes; readers wait
with a deadline. A delete that overtakes its value's arrival leaves a tombstone so the
late value is dropped instead of leaking; so does a transfer copy, once taken. A peer's
part of a transfer copy is taken only where a run (or a resume) of this worker expects it
from that peer (``expect``, ``screen``), so that no other worker, admitted to the data
plane or not, can have a run read bytes of its making, or leave arrays nobody reads. A
suspended session's arrays stay in the store off the devices (``OffloadedArray``), and a
resumed session's arrays arrive as transfer copies that the store renames to the
session's handles as they come (``adopt``).

The store charges each client session's arrays to its quota (quota.py) as they are stored
and releases the charge as they leave, under the same lock, so that the bytes a session
holds here are known exactly and two puts racing for its last bytes cannot both get them.
An array that would take its session past the quota is stored as a ``ResourceExhaustedError``
poison instead (its reader gets that error), and ``put_charged`` tells a put's caller so.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

from pathways.protocol.errors import EXHAUSTED, LOST, REMOTE
from pathways.protocol.handles import discard, session_of
from pathways.worker.quota import SessionQuota, held_bytes

_MAX_TOMBSTONES = 100_000
_NO_SENDERS: frozenset[int] = frozenset()  # a copy whose every sender's part has been screened in
# A waiter that may be abandoned (a fetch whose caller hung up) looks again at least this
# often, in case nobody woke it: a bound on how long an abandoned request keeps its thread.
_RECHECK_SECONDS = 0.5
_READY_POLL_MAX = 0.02  # longest pause between looks at whether a stored array's computation finished


class Poison:
    """Stands in for the value of a failed computation; carries the failure's message and
    the kind of error its reader gets (RemoteError, or WorkerLostError)."""

    __slots__ = ("message", "kind")

    def __init__(self, message: str, kind: str = REMOTE) -> None:
        self.message = message
        self.kind = kind

    def __repr__(self) -> str:
        return f"Poison({self.kind}: {self.message!r})"


class OffloadedArray:
    """An array of a suspended session, off the devices: its distinct shards as numpy
    pieces ((region, array), ...) in host memory, or in ``directory`` (a .npy file per
    piece, as a checkpoint's blocks: worker/checkpoints.py)."""

    __slots__ = ("dtype", "shape", "pieces", "regions", "directory")

    def __init__(self, dtype: Any, shape: tuple[int, ...], regions: list, pieces: Optional[list] = None,
                 directory: str = "") -> None:
        self.dtype, self.shape, self.regions, self.pieces, self.directory = dtype, shape, regions, pieces, directory

    def __repr__(self) -> str:
        return f"OffloadedArray({self.dtype}{list(self.shape)}{', ' + self.directory if self.directory else ''})"


def failure(what: str, error: Exception) -> Poison:
    """The poison for ``what`` having failed with ``error``. A failed collective means the
    island's group is broken (a host of it died, or did not reach the collective in time):
    readers get WorkerLostError, as they do once the controller resets the island."""
    if collective_failure(error):
        return Poison(f"{what} failed in a collective with the other hosts of its island (one was lost, or did "
                      f"not reach it in time: stopped, or starved of CPU); the island is reset: {error}", LOST)
    return Poison(f"{what} failed: {type(error).__name__}: {error}")


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failure of the island's collectives (gloo, on CPU hosts)."""
    return "gloo" in str(error).lower()


class ObjectStore:
    """Each waiter waits on a lock of its own, registered under the handle it waits for, so
    that storing a value wakes only the threads waiting for that handle (the executor
    waiting for a transfer does not also wake the fetches waiting for its outputs)."""

    def __init__(self, quota: Optional[SessionQuota] = None) -> None:
        self._entries: dict[int, Any] = {}
        self.quota = quota or SessionQuota()  # read its usage under no lock: a snapshot
        self._charged: dict[int, int] = {}  # handle of a client session -> bytes charged to the session for it
        self._lock = threading.Lock()
        self._waiters: dict[int, set[Any]] = {}  # handle -> locks of the threads waiting for it
        self._tombstones: OrderedDict[int, None] = OrderedDict()
        self._dropped_sessions: set[int] = set()
        self._copy_floor = 0  # transfer copies below it are stale (runs of before this worker joined)
        self._adopt: dict[int, tuple[int, Callable[[], None]]] = {}  # copy -> (handle, called once stored)
        # transfer copy -> the peers whose parts of it have not been screened in yet (``expect``);
        # forgotten with its tombstone, once the copy is taken
        self._expected: dict[int, frozenset[int]] = {}
        # copy not expected yet -> [what the screens waiting for it wait on, how many they are]: one
        # per copy, so that expecting a copy wakes its own screens only, however many others wait
        self._screens: dict[int, list] = {}

    def put(self, handle: int, value: Any, replace: bool = True,
            what: Callable[[], str] = lambda: "a run's output") -> bool:
        """Store ``value`` (or, past its session's quota, the poison saying so, which names
        the value as ``what()`` says); False if the handle was deleted before it arrived (or,
        with ``replace`` false, already holds a value)."""
        return self._put(handle, value, replace, what)[0]

    def put_output(self, handle: int, value: Any, what: Callable[[], str]) -> bool:
        """Store a run's output as ``put`` does; whether what the handle holds now is a
        failure (the run's own, or the quota's refusal)."""
        return type(self._put(handle, value, True, what)[1]) is Poison

    def put_charged(self, handle: int, value: Any) -> Optional[str]:
        """Store ``value`` as ``put`` does; the refusal's message where it would have taken
        its session past the quota (the handle then holds the poison saying so), else None."""
        stored = self._put(handle, value, True, lambda: "a put of")[1]
        return stored.message if type(stored) is Poison and stored is not value else None

    def refusal(self, handle: int, nbytes: int, what: str) -> Optional[str]:
        """Why storing ``nbytes`` more for ``handle`` would take its session past its quota
        (``what``: the request, for the message), or None. A check before reading an array,
        so that a put refused is refused before its bytes are read; ``put`` checks again."""
        session = session_of(handle)
        if not session:
            return None
        with self._lock:
            return self.quota.refusal(session, nbytes - self._charged.get(handle, 0), what)

    def _put(self, handle: int, value: Any, replace: bool, what: Callable[[], str]) -> tuple[bool, Any]:
        adopted = None
        with self._lock:
            if handle in self._adopt:
                copy = handle
                handle, adopted = self._adopt.pop(copy)
                self._tombstone(copy)  # a late poison for the copy must not linger
            elif not replace and handle in self._entries:
                return False, None
            stored = self._store_locked(handle, value, (lambda: "the resumed") if adopted is not None else what)
            waiters = self._waiters.pop(handle, None) if stored is not None else None
        if waiters:
            _release(waiters)
        if adopted is not None:
            adopted()
        return stored is not None, stored

    def _store_locked(self, handle: int, value: Any, what: Callable[[], str]) -> Any:
        """Store ``value`` (or the quota's poison in its place), charged to its session;
        what was stored, or None where the handle refuses it."""
        if self._refused_locked(handle):
            if session_of(handle) != 0:  # a session handle's one late value; a copy's may be several
                self._tombstones.pop(handle, None)
            return None
        session = session_of(handle)
        if session:
            self.quota.release(session, self._charged.pop(handle, 0))  # the value it replaces, if any
            if type(value) is not Poison:
                nbytes = held_bytes(value)
                refusal = self.quota.refusal(session, nbytes, f"{what()} array {handle:#x}")
                if refusal is None:
                    self.quota.charge(session, nbytes)
                    self._charged[handle] = nbytes
                else:
                    value = Poison(refusal, EXHAUSTED)
        self._entries[handle] = value
        return value

    def _remove_locked(self, handle: int) -> Any:
        """Take ``handle``'s value out (None if it holds none), releasing its charge."""
        value = self._entries.pop(handle, None)
        nbytes = self._charged.pop(handle, 0)
        if nbytes:
            self.quota.release(session_of(handle), nbytes)
        return value

    def _refused_locked(self, handle: int) -> bool:
        return (handle in self._tombstones or session_of(handle) in self._dropped_sessions
                or (handle < self._copy_floor and session_of(handle) == 0))

    def refuses(self, handle: int) -> bool:
        """Whether whatever arrives for ``handle`` is dropped: it was deleted, its session
        dropped, or it is a transfer copy already read (or stale)."""
        with self._lock:
            return self._refused_locked(handle)

    def refuse_copies_below(self, floor: int) -> None:
        """Drop transfer copies numbered below ``floor`` from now on: peers may still send
        them to this worker's id for runs dispatched before it joined (WorkerWelcome)."""
        with self._lock:
            self._copy_floor = floor

    def adopt(self, copy: int, handle: int, stored: Callable[[], None]) -> None:
        """Store transfer copy ``copy`` as ``handle`` once it arrives (at once if it has),
        then call ``stored()`` (also when ``handle`` was deleted meanwhile)."""
        with self._lock:
            value = self._remove_locked(copy)
            if value is None:
                self._adopt[copy] = (handle, stored)
                return
            self._tombstone(copy)
            self._store_locked(handle, value, lambda: "the resumed")
            waiters = self._waiters.pop(handle, None)
        if waiters:
            _release(waiters)
        stored()

    def expect(self, base: int, copies: Iterable[tuple[int, frozenset[int]]]) -> None:
        """Each ``(n, senders)`` of ``copies``: transfer copy ``base + n`` is coming for a
        run of this worker, each part of it from one of ``senders`` (peers' worker ids; this
        host's own part is handed over in memory, unscreened). Wakes the screens waiting for
        it."""
        with self._lock:
            expected, screens = self._expected, self._screens
            for n, senders in copies:
                expected[base + n] = senders
                if screens and base + n in screens:
                    screens[base + n][0].notify_all()

    def screen(self, sender: int, copy: int, timeout: float) -> bool:
        """Whether to take the part of transfer copy ``copy`` that peer ``sender`` pushes:
        only where ``expect`` named ``sender`` for it, and once. A peer may push a copy
        before this worker hears of the run that expects it (the controller sends a run to
        all of its workers at once, on their own streams), so a copy not expected yet is
        waited for, up to ``timeout`` seconds; one taken already (or stale) is not."""
        with self._lock:
            senders = self._expected.get(copy)
            if senders is None and not self._refused_locked(copy):
                waiting = self._screens.get(copy)
                if waiting is None:
                    waiting = self._screens[copy] = [threading.Condition(self._lock), 0]
                waiting[1] += 1
                try:
                    waiting[0].wait_for(lambda: copy in self._expected, timeout)
                finally:
                    waiting[1] -= 1
                    if not waiting[1]:
                        del self._screens[copy]
                senders = self._expected.get(copy)
            if senders is None or sender not in senders:
                return False
            self._expected[copy] = _NO_SENDERS if len(senders) == 1 else senders - {sender}
            return True

    def _tombstone(self, handle: int) -> None:
        self._expected.pop(handle, None)  # a copy taken: whatever comes for it from now on is refused
        self._tombstones[handle] = None
        if len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def session_entries(self, session: int) -> list[tuple[int, Any]]:
        """The (handle, value) of every array of ``session`` held here."""
        with self._lock:
            return [(h, v) for h, v in self._entries.items() if session_of(h) == session]

    def pop_if(self, handle: int, value: Any) -> bool:
        """Remove ``handle`` if it still holds ``value`` (it was not deleted or replaced)."""
        with self._lock:
            if self._entries.get(handle) is not value:
                return False
            self._remove_locked(handle)
            return True

    def get(self, handle: int) -> Optional[Any]:
        return self._entries.get(handle)

    def wait(self, handle: int, timeout: float, still_wanted: Optional[Callable[[], bool]] = None,
             take: bool = False) -> Optional[Any]:
        """The value of ``handle``, waiting up to ``timeout`` seconds (finite: callers take
        it from a checked message or a validated option); None on timeout, or as soon as
        ``still_wanted()`` turns false (checked whenever ``wake`` is called, and at least
        every half second). With ``take``, the value is removed from the store too."""
        value = self._entries.get(handle)
        if value is not None:
            if take:
                with self._lock:
                    self._remove_locked(handle)
                    self._taken_locked(handle)
            return value
        deadline = time.monotonic() + timeout
        waiter = threading.Lock()
        waiter.acquire()  # held until a put (or wake) releases it: the next acquire waits for that
        try:
            while True:
                with self._lock:
                    value = self._remove_locked(handle) if take else self._entries.get(handle)
                    if value is not None:
                        if take:
                            self._taken_locked(handle)
                        return value
                    if session_of(handle) in self._dropped_sessions:
                        return Poison("the client session that owned this array disconnected")
                    self._waiters.setdefault(handle, set()).add(waiter)
                left = deadline - time.monotonic()
                if left <= 0:
                    if take:  # its reader gives up on it: a copy arriving from now on is read by nobody
                        with self._lock:
                            value = self._remove_locked(handle)  # unless it arrived just now
                            self._taken_locked(handle)
                        return value
                    return None
                if still_wanted is not None:
                    if not still_wanted():
                        return None
                    left = min(left, _RECHECK_SECONDS)
                waiter.acquire(True, left)
        finally:
            # Usually the put that woke this waiter took its registration already.
            if waiter in self._waiters.get(handle, ()):
                with self._lock:
                    discard(self._waiters, handle, waiter)

    def wait_computed(self, handle: int, deadline: float, still_wanted: Callable[[], bool]) -> Optional[Any]:
        """The value of ``handle`` once stored and computed (an array whose computation was
        dispatched is stored before it finishes), or its poison; None if neither by
        ``deadline`` (time.monotonic), or as soon as ``still_wanted()`` turns false."""
        value = self.wait(handle, max(deadline - time.monotonic(), 0.0), still_wanted)
        if value is None or type(value) is Poison:
            return value
        pause = 0.0002
        while not value.is_ready():
            if time.monotonic() >= deadline or not still_wanted():
                return None
            time.sleep(pause)
            pause = min(pause * 2, _READY_POLL_MAX)
        return value

    def _taken_locked(self, handle: int) -> None:
        """A value was taken out for good (or waited for in vain). More may still arrive
        for a transfer copy, which is read once and whose number never comes back: the
        bytes or poison of each of its senders, when it was taken as the poison of one
        of them; the controller's poison, when a sender's island was lost after the copy
        arrived. The copy's tombstone drops each of them, instead of leaving it in the
        store, and stays (the oldest of many are forgotten) because there may be several."""
        if session_of(handle) == 0:
            self._tombstone(handle)

    def wake(self) -> None:
        """Have every waiter look again (one of them may no longer be wanted)."""
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        for locks in waiters.values():
            _release(locks)

    def pop(self, handle: int) -> None:
        with self._lock:
            self._remove_locked(handle)

    def delete(self, handles: Iterable[int]) -> None:
        with self._lock:
            for h in handles:
                if self._remove_locked(h) is None:
                    self._tombstone(h)

    def drop_session(self, session: int) -> tuple[int, int]:
        """Delete every buffer of ``session`` and refuse its late arrivals; returns how many
        arrays went and the bytes charged to the session for them."""
        with self._lock:
            self._dropped_sessions.add(session)
            doomed = [h for h in self._entries if session_of(h) == session]
            for h in doomed:
                del self._entries[h]
                self._charged.pop(h, None)
            nbytes = self.quota.drop(session)
        self.wake()  # waiters for the session's arrays give up now
        return len(doomed), nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def session_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        with self._lock:
            for h in self._entries:
                counts[session_of(h)] = counts.get(session_of(h), 0) + 1
        return counts


def _release(waiters: Iterable[Any]) -> None:
    for waiter in waiters:
        try:
            waiter.release()
        except RuntimeError:  # released already (by a wake), and not waited on again yet
            pass
