"""Suspend and resume on a worker: a part of the worker's core (WorkerCore), working on its
state. A suspended session's arrays leave the store and the devices (``Offload``), into
host memory or files the worker writes (each array as a checkpoint of its blocks,
worker/checkpoints.py); ``Restore`` pushes them to the hosts of the new
placement as transfer copies, which each receiver stores under the session's handles
(``Adopt``)."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np

from pathways.errors import RemoteError
from pathways.protocol.check import MAX_TEXT
from pathways.protocol.errors import LOST
from pathways.protocol.messages import Adopt, Adopted, Offload, Offloaded, Restore
from pathways.worker.checkpoints import read_region, saved_blocks, write_block
from pathways.worker.pieces import local_pieces
from pathways.worker.store import OffloadedArray, Poison, failure

log = logging.getLogger("pathways.worker")


class Offloading:
    """WorkerCore's handlers of Offload, Restore and Adopt."""

    # ---- suspend and resume -------------------------------------------------------------

    def _refuse_suspend_path(self, path: str) -> str:
        """Why this worker does not write files under ``path`` (a client's), or "": only
        under the directory its operator allowed, so that no client can have a worker write
        where it pleases."""
        if self.suspend_dir is None:
            return (f"worker {self.worker_id} writes no suspend files (its operator allowed no directory: "
                    "`pathways worker --suspend-dir DIR`, `pathways up --suspend-dir DIR`, "
                    "pw.local_cluster(suspend_dir=DIR)); it keeps the session's arrays in its host memory instead")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.suspend_dir]) != self.suspend_dir:
            return (f"worker {self.worker_id} writes suspend files only under {self.suspend_dir} (--suspend-dir), "
                    f"not under {path!r}; it keeps the session's arrays in its host memory instead")
        return ""

    def _offload(self, msg: Offload) -> None:
        """Move every array of the session off the devices (host memory, or files under
        the Offload's path), and tell the controller which, with their shapes."""
        session, directory, warning = msg.session, "", ""
        if msg.path:
            warning = self._refuse_suspend_path(msg.path)
        if msg.path and not warning:
            directory = os.path.join(msg.path, f"session-{session}", f"worker-{self.worker_id}")
            try:
                os.makedirs(directory, exist_ok=True)
                if not os.access(directory, os.W_OK):
                    raise PermissionError(f"{directory} is not writable")
            except OSError as e:
                warning = (f"worker {self.worker_id} could not write under {msg.path!r} ({e}); it keeps the "
                           "session's arrays in its host memory instead")
                directory = ""
        arrays: list = []
        failed: list = []
        nbytes = 0
        offloaded: dict[int, OffloadedArray] = {}
        for handle, value in self.store.session_entries(session):
            if type(value) is Poison:
                if self.store.pop_if(handle, value):
                    failed.append((handle, value.kind, value.message[:MAX_TEXT]))
                continue
            try:
                dtype, shape, pieces = local_pieces(value)
            except Exception as e:
                poison = failure(f"the computation of array {handle:#x} on worker {self.worker_id}", e)
                if self.store.pop_if(handle, value):
                    failed.append((handle, poison.kind, poison.message[:MAX_TEXT]))
                continue
            off = None
            if directory:  # as a checkpoint of the array: a file per block (worker/checkpoints.py)
                path = os.path.join(directory, f"{handle:x}")
                try:
                    os.makedirs(path, exist_ok=True)
                    for region, piece in pieces:
                        write_block(path, region, piece)
                    off = OffloadedArray(dtype, shape, [r for r, _ in pieces], directory=path)
                except OSError as e:
                    warning = warning or (f"worker {self.worker_id} could not write {path} ({e}); it keeps "
                                          "the arrays it could not write in its host memory")
            if off is None:  # a copy of a view of the device buffer, which would keep it alive
                off = OffloadedArray(dtype, shape, [r for r, _ in pieces],
                                     [(r, p if p.flags.owndata else np.array(p, copy=True)) for r, p in pieces])
            if self.store.pop_if(handle, value):  # not deleted meanwhile
                offloaded[handle] = off
                arrays.append((handle, tuple(shape)))
                nbytes += sum(p.nbytes for _, p in pieces)
            del pieces
        with self._suspended_lock:
            self._suspended.setdefault(session, {}).update(offloaded)
            if directory:
                self._offload_dirs[session] = directory
        log.info("offloaded %d array(s) (%d bytes) of session %d%s", len(arrays), nbytes, session,
                 f" to {directory}" if directory else " to host memory")
        self.up(Offloaded(session, tuple(arrays), tuple(failed[:1 << 12]), nbytes, warning))

    def _restore(self, msg: Restore) -> None:
        """Push the resumed session's offloaded arrays to the hosts of their new layouts,
        as the moves say, then forget every array of the session offloaded here."""
        with self._suspended_lock:
            held = self._suspended.pop(msg.session, {})
            directory = self._offload_dirs.pop(msg.session, "")
        for handle, copy, layout, routes in msg.moves:
            off = held.pop(handle, None)
            poison, dtype, shape, pieces = None, None, (), []
            if off is None:
                poison = Poison(f"array {handle:#x} of the suspended session was not on worker {self.worker_id} "
                                "when it resumed (deleted, or never arrived)")
            else:
                try:
                    pieces = off.pieces if off.directory == "" else _read_pieces(off)
                    dtype, shape = off.dtype, off.shape
                except (OSError, ValueError, RemoteError) as e:
                    poison = Poison(f"worker {self.worker_id} could not read array {handle:#x} back from "
                                    f"{off.directory}: {e}")
            self._deliver(copy, poison, dtype, shape, pieces, layout.to_wire(), routes)
            del off, pieces
        if directory:
            shutil.rmtree(directory, ignore_errors=True)

    def _forget_offloaded(self, session: int) -> None:
        with self._suspended_lock:
            self._suspended.pop(session, None)
            directory = self._offload_dirs.pop(session, "")
        if directory:
            shutil.rmtree(directory, ignore_errors=True)

    def _adopt(self, msg: Adopt) -> None:
        """Store each arriving copy as its session handle; answer Adopted once all have
        arrived, or after ``wait_timeout`` with the missing ones poisoned."""
        pairs = [(copy, handle) for copy, handle, _ in msg.arrivals]
        self.store.expect(0, [(copy, frozenset(senders) - {self.worker_id}) for copy, _, senders in msg.arrivals])
        state = {"left": len(pairs), "late": 0, "expired": False}
        lock = threading.Lock()

        def stored() -> None:
            with lock:
                state["left"] -= 1
                state["late"] += state["expired"]
                finished = state["left"] == 0
            if finished:
                timer.cancel()
                self.up(Adopted(msg.session, len(pairs), state["late"]))

        def expire() -> None:
            with lock:
                state["expired"] = True
            for copy, handle in pairs:
                self.store.put(copy, Poison(f"array {handle:#x} did not reach worker {self.worker_id} within "
                                            f"{self.wait_timeout:.0f} s of the session's resume: its sender "
                                            "failed", LOST), replace=False)

        timer = threading.Timer(self.wait_timeout, expire)
        timer.daemon = True
        if not pairs:
            self.up(Adopted(msg.session, 0, 0))
            return
        timer.start()
        for copy, handle in pairs:
            self.store.adopt(copy, handle, stored)


def _read_pieces(off: OffloadedArray) -> list:
    """The pieces of an array offloaded to files, read back as a checkpoint's blocks are."""
    blocks = saved_blocks(off.directory)
    return [(region, read_region(blocks, region, off.dtype, off.directory)) for region in off.regions]
