"""Which client sessions a worker serves, and the credential each must present.

The controller draws a secret per session and tells every worker when the session opens
(SessionOpen, with the digest of what the session presents to this worker:
messages.worker_credential) and closes (DropSession). A client's put or fetch
names a handle and carries a credential; it is served only when the credential is that of
the handle's session (``session_of``; digests compared in constant time). Handles of the
controller's own session 0 (transfer copies) are never served to clients.

A fetch may wait for its array, holding one of the worker's gRPC threads meanwhile; so
that no client holds them all, only a few fetches of a session wait at once, and in all
fewer than the worker's threads, leaving some to puts and the rest (``FetchWaits``); others
are answered at once.

The client learns its credential on its own connection to the controller, the worker on
another, so a client's first put may arrive before the worker has heard of its session:
a session not heard of yet is waited for, a bounded time, by a few calls at once: a wait
for a session takes one of the same ``FetchWaits`` as a fetch's wait for its array (a
session that never opens would otherwise have its calls hold every thread), and a call
that finds none left is answered at once. Session ids only grow and the
controller tells a worker of sessions in the order they opened, so a session not open
whose id is at most the highest heard of has closed (or closed before this worker
registered) and is refused at once.
"""

from __future__ import annotations

import hmac
import threading

from pathways.errors import AccessDeniedError
from pathways.protocol.handles import session_of
from pathways.protocol.messages import digest

SESSION_WAIT_SECONDS = 5.0  # how long a put or fetch waits for the controller to announce its session
# Calls that may wait (each holds one of the worker's gRPC threads) at once, fetches for
# their arrays and calls for their session's announcement: per session, and in all. The
# worker has GRPC_THREADS: the waits leave FREE_THREADS of them to puts and others, so no
# client, and no few clients, hold the threads those need. A fetch beyond them is answered
# at once ("pending" if the array is not ready), and its client asks again after a pause:
# enough waits that hundreds of clients, each waiting for its result, wait instead of asking
# again and again (each refused ask costs the worker and the client a call).
WAITING_FETCHES_PER_SESSION = 8  # as many as an IFRT session waits on at once (its pool)
WAITING_FETCHES = 256
FREE_THREADS = 16
GRPC_THREADS = WAITING_FETCHES + FREE_THREADS


class Sessions:
    def __init__(self, waits: FetchWaits, wait: float = SESSION_WAIT_SECONDS) -> None:
        self.waits = waits
        self.wait = wait
        self._digests: dict[int, bytes] = {}  # open session -> digest of its credential
        self._highest = 0  # the highest session id heard of, open or closed
        self._cond = threading.Condition()

    def open(self, session: int, credential_digest: bytes) -> None:
        with self._cond:
            self._digests[session] = credential_digest
            self._highest = max(self._highest, session)
            self._cond.notify_all()

    def close(self, session: int) -> None:
        with self._cond:
            self._digests.pop(session, None)
            self._highest = max(self._highest, session)
            self._cond.notify_all()

    def heard_of(self, session: int, timeout: float) -> bool:
        """Whether this worker knows whether ``session`` is open, waiting up to ``timeout``
        seconds for the controller to announce it where one of ``waits`` is free."""
        with self._cond:
            if session <= self._highest:
                return True
        if timeout <= 0 or not self.waits.slot(session):
            return False
        try:
            with self._cond:
                return self._cond.wait_for(lambda: session <= self._highest, timeout)
        finally:
            self.waits.release(session)

    def admit(self, handle: int, credential: bytes, what: str) -> None:
        """Return if ``credential`` is that of ``handle``'s session, else raise
        AccessDeniedError saying why (``what``: "put" or "fetch"). A session not heard of
        is waited for up to ``self.wait`` seconds."""
        session = session_of(handle)
        if session == 0:
            raise AccessDeniedError(f"this worker refused a {what} of array {handle:#x}: it is a copy the "
                                    "controller made for a program, not a client's array; clients read and write "
                                    "only the arrays of their own session")
        self.admit_session(session, credential, f"{what} of array {handle:#x}", "the array belongs to")

    def admit_session(self, session: int, credential: bytes, subject: str, owner: str = "it is for",
                      wait: float | None = None) -> None:
        """Return if ``credential`` is that of ``session`` (waited for up to ``wait``
        seconds, by default ``self.wait``, if not heard of), else raise AccessDeniedError
        saying why. ``subject``: what was asked ("fetch of array 0x..."); ``owner``: how
        the refusal names what the session owns."""
        wait = self.wait if wait is None else wait
        if not self.heard_of(session, wait):
            waited = f" (a call waits up to {wait:g} s for that, unless many others wait)" if wait else ""
            raise AccessDeniedError(f"this worker refused a {subject}: the controller has not announced its "
                                    f"session {session} yet{waited}. Use handles from "
                                    "this client's session; if they are, check that the worker and the client "
                                    "talk to the same controller (`python -m pathways status`)")
        with self._cond:
            expected = self._digests.get(session)
        if expected is None:
            raise AccessDeniedError(f"this worker refused a {subject}: its session {session} "
                                    "has closed, and its arrays with it; connect again (pw.connect) and "
                                    "recreate them")
        if not hmac.compare_digest(expected, digest(credential)):
            raise AccessDeniedError(f"this worker refused a {subject}: {owner} "
                                    f"session {session}, and the credential presented is not that session's. "
                                    "A client reads and writes only the arrays it created itself")


class FetchWaits:
    """Who may wait now, in a fetch for its array or for its session's announcement:
    ``slot(session)`` is true (and must be given back with ``release``) while the session
    has fewer than its share of waits and all sessions fewer than the total."""

    def __init__(self, per_session: int = WAITING_FETCHES_PER_SESSION, total: int = WAITING_FETCHES) -> None:
        self._per_session = per_session
        self._total = total
        self._waiting: dict[int, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    def slot(self, session: int) -> bool:
        with self._lock:
            mine = self._waiting.get(session, 0)
            if mine >= self._per_session or self._count >= self._total:
                return False
            self._waiting[session] = mine + 1
            self._count += 1
            return True

    def waiting(self) -> int:
        """How many calls wait now."""
        return self._count

    def release(self, session: int) -> None:
        with self._lock:
            left = self._waiting[session] - 1
            if left:
                self._waiting[session] = left
            else:
                del self._waiting[session]
            self._count -= 1
