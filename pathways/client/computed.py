"""Which outputs of a session's runs are computed, as the controller says: a part of the
client session (Session). A run sent with ``notify`` (Session.submit) has its outputs
expected here; once every worker has finished it, the controller says so (m.Computed), and
a wait for those outputs (``wait``) needs no request to a worker, nor does reading the
small ones, whose bytes come with the news (``value``). A poisoned output counts as failed.
Only what the caller expects is kept, until it releases the handle: at most ``MAX_EXPECTED``
handles and ``MAX_VALUE_BYTES`` of values at once (beyond them, a wait or a read says it does
not know, and the caller asks the workers, as it does for every other array)."""

from __future__ import annotations

import threading
import time
from typing import Iterable, Optional, Sequence

MAX_EXPECTED = 1 << 16
MAX_VALUE_BYTES = 16 << 20
_NOT_KEPT = object()


class Computations:
    def __init__(self) -> None:
        # handle -> None while its run is running, True once computed, False once it failed
        self._state: dict[int, Optional[bool]] = {}
        self._values: dict[int, bytes] = {}  # handle -> its bytes, for small outputs computed
        self._value_bytes = 0
        # reentrant: ``forget`` runs in finalizers, which may run in a thread holding it
        self._changed = threading.Condition(threading.RLock())
        self._closed = False

    def expect(self, handles: Sequence[int]) -> bool:
        """Keep track of ``handles``, the outputs of a run about to be sent; False where
        they are too many to keep, or the session closed (the run then need not ask to be told)."""
        if self._closed or len(self._state) + len(handles) > MAX_EXPECTED:
            return False
        with self._changed:
            for h in handles:
                self._state[h] = None
        return True

    def computed(self, handles: Iterable[int], ok: bool, values: Iterable[tuple[int, bytes]] = ()) -> None:
        """The controller said ``handles`` were computed (``ok``) or failed, with the bytes
        of the small ones (``values``); those not expected (released since, or never kept)
        are ignored."""
        state = self._state
        with self._changed:
            for h, raw in values:
                if h in state and self._value_bytes + len(raw) <= MAX_VALUE_BYTES:
                    self._value_bytes += len(raw) - len(self._values.get(h, b""))
                    self._values[h] = raw
            for h in handles:
                if h in state:
                    state[h] = ok
            self._changed.notify_all()

    def value(self, handle: int) -> Optional[bytes]:
        """The bytes the controller sent of output ``handle`` (computed), if it sent them."""
        return self._values.get(handle)

    def forget(self, handle: int) -> None:
        """``handle`` was released (called from finalizers too, in any thread)."""
        if handle not in self._state:
            return  # most released handles were never expected: no lock for them
        with self._changed:
            self._state.pop(handle, None)
            raw = self._values.pop(handle, None)
            if raw is not None:
                self._value_bytes -= len(raw)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._state.clear()
            self._values.clear()
            self._value_bytes = 0
            self._changed.notify_all()

    def wait(self, handles: Sequence[int], timeout: float) -> Optional[bool]:
        """Wait up to ``timeout`` seconds until every one of ``handles`` is computed: True
        when all were, False if one failed, None if one is not kept here (never expected,
        released, or the session closed) or still running at the deadline; the caller then
        asks the workers, who know the value or the error."""
        state = self._state
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if self._closed:
                    return None
                values = [state.get(h, _NOT_KEPT) for h in handles]
                if any(v is False for v in values):
                    return False
                if any(v is _NOT_KEPT for v in values):
                    return None
                if all(v is True for v in values):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
