"""``pw.Array``: a future over a handle whose buffers live on a worker.

Its shape, dtype and sharding are known at once (they are static); its value is fetched
from the worker that holds it, never through the controller. Dropping the last reference
queues a batched delete.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from pathways.client.devices import NamedSharding
from pathways.errors import ArrayDeletedError, DeadlineExceededError, RemoteError, WorkerLostError
from pathways.ir import reading_positions


class _Buffer:
    """Owns one handle; its finalizer releases the handle on the workers."""

    __slots__ = ("session", "handle", "slice", "deleted", "__weakref__")

    def __init__(self, session: Any, handle: int, slice: Any) -> None:
        self.session = session
        self.handle = handle
        self.slice = slice  # a client Slice: its hosts hold the array's parts
        self.deleted = False

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every host holding a part of the array, where they are now (a slice moves when
        its island heals or its session resumes elsewhere)."""
        return self.slice.addresses

    def delete(self) -> None:
        if not self.deleted:
            self.deleted = True
            self.session.release(self.handle)

    def __del__(self) -> None:
        try:
            self.delete()
        except Exception:  # at interpreter exit the session may be half torn down
            pass


class Array:
    """A sharded array on the cluster. ``np.asarray(a)`` fetches its value."""

    __array_priority__ = 100
    _origin = ""  # what computed it, when its errors must name it (a fused node)

    def __init__(self, buffer: _Buffer, shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> None:
        self._buffer = buffer
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def handle(self) -> int:
        return self._buffer.handle

    def _live(self) -> _Buffer:
        if self._buffer.deleted:
            raise ArrayDeletedError(f"this {self._describe()} was deleted; keep a reference to "
                                    "arrays you still need instead of calling .delete()")
        return self._buffer

    def is_ready(self) -> bool:
        """True once the value is computed (or its computation failed)."""
        b = self._live()
        try:
            return b.session.fetch(lambda: b.addresses, b.handle, 0.0, data=False) is not None
        except (RemoteError, WorkerLostError):
            return True

    def block_until_ready(self, timeout: Optional[float] = None) -> "Array":
        """Wait until computed; raises RemoteError if its computation failed."""
        b = self._live()
        wait = b.session.result_timeout if timeout is None else timeout
        if self._fetch(b, wait, False) is None:
            raise DeadlineExceededError(f"{self._describe()} was not ready after {wait:.0f} s")
        return self

    def to_numpy(self, timeout: Optional[float] = None) -> np.ndarray:
        b = self._live()
        wait = b.session.result_timeout if timeout is None else timeout
        value = self._fetch(b, wait, True)
        if value is None:
            raise DeadlineExceededError(f"{self._describe()} was not ready after {wait:.0f} s; "
                                        "pass a longer timeout or check the cluster")
        return value

    def _fetch(self, b: _Buffer, wait: float, data: bool) -> Any:
        where = lambda: b.addresses  # noqa: E731
        if data:  # a block replicated on several hosts comes from one of them
            layout = self.sharding.layout()
            asked = reading_positions(self.shape, layout)
            if len(asked) < len(layout.workers):
                where = lambda: tuple(b.addresses[i] for i in asked)  # noqa: E731
        try:
            return b.session.fetch(where, b.handle, wait, data=data)
        except RemoteError as e:
            if not self._origin or self._origin in str(e):
                raise
            # The worker names the array; a failure inside a fused executable may surface
            # only where its result is read, so name the nodes that computed it.
            raise type(e)(f"{e} (it was computed by {self._origin})") from None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.to_numpy()
        return value.astype(dtype) if dtype is not None else value

    def delete(self) -> None:
        """Free the buffers on the workers now; the array is unusable afterwards."""
        self._buffer.delete()

    def is_deleted(self) -> bool:
        return self._buffer.deleted

    def _describe(self) -> str:
        return f"pw.Array {self.dtype}{list(self.shape)}"

    def __repr__(self) -> str:
        state = "deleted" if self._buffer.deleted else f"handle={self.handle:#x}"
        return f"pw.Array({self.dtype}{list(self.shape)}, {state})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d pw.Array")
        return self.shape[0]
