"""Which client sessions a worker serves, and the credential each must present.

The controller draws a secret per session and tells every worker when the session opens
(SessionOpen, with the secret's digest) and closes (DropSession). A client's put or fetch
names a handle and carries a credential; it is served only when the credential is that of
the handle's session (``session_of``; digests compared in constant time). Handles of the
controller's own session 0 (transfer copies) are never served to clients.

The client learns its credential on its own connection to the controller, the worker on
another, so a client's first put may arrive before the worker has heard of its session:
a session not heard of yet is waited for, a bounded time. Session ids only grow and the
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

SESSION_WAIT_SECONDS = 5.0  # how long a put waits for the controller to announce its session


class Sessions:
    def __init__(self, wait: float = SESSION_WAIT_SECONDS) -> None:
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
        seconds for the controller to announce it."""
        with self._cond:
            return self._cond.wait_for(lambda: session <= self._highest, timeout)

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

    def admit_session(self, session: int, credential: bytes, subject: str, owner: str = "it is for") -> None:
        """Return if ``credential`` is that of ``session`` (waited for up to ``self.wait``
        seconds if not heard of), else raise AccessDeniedError saying why. ``subject``:
        what was asked ("fetch of array 0x..."); ``owner``: how the refusal names what
        the session owns."""
        if not self.heard_of(session, self.wait):
            raise AccessDeniedError(f"this worker refused a {subject}: the controller did not "
                                    f"announce its session {session} within {self.wait:g} s. Use handles from "
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
