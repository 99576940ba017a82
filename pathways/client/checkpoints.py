"""Checkpoints the workers write and read themselves: a part of the client session
(Session), working on its state. A save asks each host that holds a distinct block of an
array to write it into the checkpoint's directory; a load asks each host of the new layout
to make its blocks from what is there, and is then told to the controller as a put is
(PutNotice). The array's bytes never pass through this process (worker/checkpoints.py says
where the files go)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import grpc
import numpy as np

from pathways import errors
from pathways.client.worker_calls import all_answered, answer
from pathways.ir import Layout, block_holders
from pathways.protocol import messages as m
from pathways.protocol import operator
from pathways.wire import codec


class Checkpoints:
    """Session's saves and loads."""

    def save_blocks(self, addresses: tuple[str, ...], handle: int, layout: Layout, shape: tuple[int, ...],
                    path: str, timeout: Optional[float] = None) -> Future:
        """Have the hosts of array ``handle`` (laid out by ``layout``; ``addresses[i]`` is
        that of ``layout.workers[i]``) write its blocks into checkpoint directory ``path``,
        each distinct block once, by the first host that holds it, once the array is
        computed (within ``timeout`` seconds; default the session's result timeout). A
        Future of the hosts' answers (Saved: the bytes each wrote), failing with the first
        error a host answered."""
        if layout.unreduced:
            raise ValueError("an unreduced array cannot be saved as it is; reduce it first")
        wait = min(self.result_timeout if timeout is None else timeout, m.MAX_WAIT_SECONDS)
        holders = block_holders(shape, layout)
        calls = []
        for worker, address in zip(layout.workers, addresses):
            if worker in holders:
                stubs = self._stubs(address)
                request = m.pack(m.SaveRequest(handle, stubs.credential, path, holders[worker], wait).encode())
                calls.append((address, stubs.save.future(request, timeout=wait + 30.0)))
        return all_answered(calls, operator.SAVED_REPLY, "saving")

    def load_blocks(self, addresses: tuple[str, ...], handle: int, layout: Layout, dtype: np.dtype,
                    shape: tuple[int, ...], path: str, moves: int) -> None:
        """Have each host of ``layout`` make its blocks of a new array ``handle``, of
        ``dtype`` and ``shape``, from checkpoint directory ``path``, and tell the controller
        of the array as of a put (``moves`` as ``put`` takes it). No waiting: a host that
        cannot poisons the array with why (there, and here for its readers)."""
        with self._starting_put():
            for address in addresses:
                stubs = self._stubs(address)
                request = m.pack(m.LoadRequest(handle, stubs.credential, path, layout, codec.dtype_name(dtype),
                                               tuple(shape)).encode())
                self._watch_put(stubs.load.future(request, timeout=self.result_timeout),
                                lambda f, address=address: self._loaded(f, address, handle))
            self.send(m.PutNotice(handle, layout, moves))

    def _loaded(self, f: grpc.Future, address: str, handle: int) -> None:
        try:
            answer(f, address, operator.SAVED_REPLY)
        except errors.PathwaysError as e:
            self.poisoned.setdefault(handle, (type(e), f"loading the array from the checkpoint failed: {e}"))
