"""Checkpoints that the workers write and read themselves: a part of the worker's core
(WorkerCore), working on its state. A save writes the blocks of an array that this host
holds, each to a file of its own in the checkpoint's directory; a load makes this host's
blocks of an array, in any layout, from the blocks found there, and stores them as a put
would. No byte of the array passes through the controller or the client.

Where: a client names a location, which is read under the directory the operator allowed
(``--checkpoint-dir DIR``): ``gs://BUCKET/PATH`` is ``DIR/BUCKET/PATH``, an absolute path must
lie under DIR, a relative one is taken from DIR. Nothing is written or read elsewhere, so a
client cannot have a worker touch files the operator did not give it.

An array's directory holds one ``.npy`` file per distinct block (``0-4_0-8.npy``: rows 0 to
4, columns 0 to 8; ``scalar.npy`` for a 0-d array), written under a temporary name and
renamed once whole, so that a reader never sees part of a block."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from pathways.errors import (AccessDeniedError, DeadlineExceededError, PathwaysError, RemoteError,
                             ResourceExhaustedError, WireError)
from pathways.protocol.data import ArrayPut
from pathways.protocol.errors import POISON_KINDS, REMOTE, error_of, kind_of
from pathways.protocol.handles import session_of
from pathways.protocol.messages import LoadRequest, SaveRequest, Saved
from pathways.wire import codec
from pathways.worker.pieces import host_regions, local_pieces
from pathways.worker.quota import layout_bytes
from pathways.worker.store import Poison

_BLOCK_FILE = re.compile(r"^(scalar|\d+-\d+(_\d+-\d+)*)\.npy$")
Region = tuple[tuple[int, int], ...]
# numpy reads a .npy header with Python's ast, which some CPython releases (3.11.7 among
# them) do not run safely from several threads at once ("SystemError: AST constructor
# recursion depth mismatch"): one header at a time, the bytes after it read in parallel
_HEADERS = threading.Lock()


def checkpoint_path(root: Optional[str], location: str, worker: int) -> str:
    """The directory ``location`` names under the operator's checkpoint directory ``root``
    (a real path); AccessDeniedError where there is none, or the location lies outside it."""
    if root is None:
        raise AccessDeniedError(
            f"worker {worker} reads and writes no checkpoints: its operator allowed no directory "
            "(`pathways worker --checkpoint-dir DIR`, `pathways up --checkpoint-dir DIR`, "
            "pw.local_cluster(checkpoint_dir=DIR))")
    if not location or "\0" in location:
        raise WireError("a checkpoint location must be a non-empty path without NUL characters")
    if location.startswith("gs://"):
        path = os.path.join(root, location[len("gs://"):].lstrip("/"))
    else:
        path = os.path.join(root, location)  # an absolute location stays itself
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise AccessDeniedError(f"worker {worker} reads and writes checkpoints only under {root} "
                                f"(--checkpoint-dir), not at {location!r}")
    return real


def block_name(region: Region) -> str:
    return "_".join(f"{a}-{b}" for a, b in region) + ".npy" if region else "scalar.npy"


def _region_of_name(name: str) -> Region:
    stem = name[:-len(".npy")]
    if stem == "scalar":
        return ()
    return tuple((int(a), int(b)) for a, b in (part.split("-") for part in stem.split("_")))


def saved_blocks(directory: str) -> dict[Region, str]:
    """The blocks saved in ``directory``: region -> file."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise RemoteError(f"no checkpoint at {directory}: the directory does not exist") from None
    return {_region_of_name(n): os.path.join(directory, n) for n in names if _BLOCK_FILE.match(n)}


def write_block(directory: str, region: Region, block: np.ndarray) -> None:
    final = os.path.join(directory, block_name(region))
    partial = f"{final}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.save(f, block if block.flags.c_contiguous else block.copy(order="C"), allow_pickle=False)
    os.replace(partial, final)


def read_region(blocks: dict[Region, str], region: Region, dtype: np.dtype, where: str) -> np.ndarray:
    """Block ``region`` of the saved array, of ``dtype``, from the saved ``blocks``, however
    they were cut; RemoteError where they do not cover it or hold another dtype."""
    if any(a == b for a, b in region):  # an empty block: nothing to read (numpy maps no empty file)
        return np.empty(tuple(b - a for a, b in region), dtype)
    exact = blocks.get(region)
    if exact is not None:
        return _read_block(exact, dtype, region, where)
    out = np.empty(tuple(b - a for a, b in region), dtype)
    covered = np.zeros(out.shape, bool)
    for saved, path in blocks.items():
        if len(saved) != len(region):
            raise RemoteError(f"the checkpoint at {where} holds blocks of a {len(saved)}-d array, not a "
                              f"{len(region)}-d one")
        common = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, saved))
        if any(lo >= hi for lo, hi in common):
            continue
        block = _as(_mapped(path), dtype, saved, where)
        into = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(common, region))
        out[into] = block[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(common, saved))]
        covered[into] = True
    if not covered.all():
        raise RemoteError(f"the checkpoint at {where} does not hold all of block {list(region)} of the array "
                          "(saved with another shape, or only in part)")
    return out


def _read_block(path: str, dtype: np.dtype, region: Region, where: str) -> np.ndarray:
    """The block saved whole as ``path``, read with one copy into a buffer aligned for the
    device (which can then take it without another); its header checked against the block
    before anything is allocated or read: a file's header may claim any size."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        with _HEADERS:
            shape, fortran_order, saved = header[version](f) if version in header else (None, True, None)
        if not fortran_order:  # as the workers write them
            _check_block(saved, shape, dtype, region, where)
            out = codec.aligned_empty(tuple(shape), dtype)
            flat = out.reshape(-1).view(np.uint8)
            if f.readinto(memoryview(flat)) != flat.nbytes or f.read(1):
                raise RemoteError(f"block {list(region)} of the checkpoint at {where} holds other than "
                                  f"{flat.nbytes} bytes of values")
            return out
    # another numpy version's, or in Fortran order: mapped, checked, then copied in C order
    return np.ascontiguousarray(_as(_mapped(path), dtype, region, where))


def _mapped(path: str) -> np.ndarray:
    """The array saved as ``path``, mapped (its header read under ``_HEADERS``)."""
    with _HEADERS:
        return np.load(path, mmap_mode="r", allow_pickle=False)


def _check_block(saved: np.dtype, shape: tuple[int, ...], dtype: np.dtype, region: Region, where: str) -> None:
    """RemoteError unless values of dtype ``saved`` and ``shape`` are block ``region`` of
    ``dtype``: numpy saves the ML dtypes (bfloat16, float8...) as raw bytes of their size."""
    if saved != dtype and (saved.kind != "V" or saved.itemsize != dtype.itemsize):
        raise RemoteError(f"the checkpoint at {where} holds {saved.name} values, not {dtype.name}")
    if tuple(shape) != tuple(b - a for a, b in region):
        raise RemoteError(f"block {list(region)} of the checkpoint at {where} has shape {list(shape)}")


def _as(block: np.ndarray, dtype: np.dtype, region: Region, where: str) -> np.ndarray:
    """A saved ``block`` read as ``dtype``: numpy saves the ML dtypes (bfloat16, float8...) as
    raw bytes of their size."""
    _check_block(block.dtype, block.shape, dtype, region, where)
    return block if block.dtype == dtype else block.view(dtype)


class Checkpoints:
    """WorkerCore's Save and Load."""

    def save(self, req: SaveRequest, still_wanted: Callable[[], bool]) -> Saved:
        """Write this host's blocks ``req.blocks`` of the array into its checkpoint directory,
        once it is computed (within ``req.wait`` seconds). Raises the error to answer."""
        self.sessions.admit(req.handle, req.credential, "save")
        directory = checkpoint_path(self.checkpoint_dir, req.path, self.worker_id)
        session = session_of(req.handle)
        # a wait holds a server thread: a session gets as many as its fetches may (FetchWaits)
        waits = req.wait > 0 and self.fetch_waits.slot(session)
        try:
            value = self._computed(req, req.wait if waits else 0.0, still_wanted, starved=req.wait > 0 and not waits)
        finally:
            if waits:
                self.fetch_waits.release(session)
        _, _, pieces = local_pieces(value)
        held = dict(pieces)
        wanted = [tuple(tuple(bound) for bound in block) for block in req.blocks]
        missing = [list(b) for b in wanted if b not in held]
        if missing:
            raise WireError(f"worker {self.worker_id} holds no block {missing[0]} of array {req.handle:#x}; it "
                            f"holds {[list(r) for r in held][:8]}")
        os.makedirs(directory, exist_ok=True)
        for block in wanted:
            write_block(directory, block, held[block])
        return Saved(sum(held[b].nbytes for b in wanted))

    def _computed(self, req: SaveRequest, wait: float, still_wanted: Callable[[], bool], starved: bool) -> Any:
        """The computed value of the array to save, waiting ``wait`` seconds at most;
        ``starved``: it may not wait, the session's waits here being all taken."""
        value = self.store.wait_computed(req.handle, time.monotonic() + wait, still_wanted)
        if value is None:
            raise DeadlineExceededError(
                f"array {req.handle:#x} was not computed within {wait:g} s on worker {self.worker_id}, so it was "
                "not saved" + (" (the session's waits on this worker are all taken: save fewer arrays at once, or "
                               "once they are computed)" if starved else ""))
        if type(value) is Poison:
            raise error_of(value.kind, f"array {req.handle:#x} cannot be saved: {value.message}")
        return value

    def load(self, req: LoadRequest) -> Saved:
        """Make this host's blocks of the array from the checkpoint and store them as a put
        of them would. Raises the error to answer."""
        self.sessions.admit(req.handle, req.credential, "load")
        try:
            return self._load(req)
        except PathwaysError as e:
            # what waits for the array (a run, a read) fails with why, instead of waiting for it
            kind = kind_of(e)
            self._poisoned(req.handle, Poison(f"loading array {req.handle:#x} from the checkpoint at {req.path} "
                                              f"failed on worker {self.worker_id}: {e}",
                                              kind if kind in POISON_KINDS else REMOTE))
            raise
        except Exception as e:  # a file numpy cannot read as an array (ValueError), a disk's error (OSError)
            message = (f"loading array {req.handle:#x} from the checkpoint at {req.path} failed on worker "
                       f"{self.worker_id}: {type(e).__name__}: {e}")
            self._poisoned(req.handle, Poison(message))
            raise RemoteError(message) from None

    def _load(self, req: LoadRequest) -> Saved:
        if req.layout.unreduced:
            raise WireError("an unreduced array cannot be loaded from a checkpoint: load it reduced")
        directory = checkpoint_path(self.checkpoint_dir, req.path, self.worker_id)
        dtype, shape = codec.dtype_of_name(req.dtype), tuple(req.shape)
        sharding = self.executables.sharding(req.layout)
        # refused past the session's quota before anything is read or allocated, as a put is
        refusal = self.store.refusal(req.handle, layout_bytes(sharding, shape, dtype),
                                     f"a load of {dtype.name}{list(shape)} array {req.handle:#x}")
        if refusal is not None:
            raise ResourceExhaustedError(refusal)
        blocks = saved_blocks(directory)
        regions = host_regions(sharding, shape)
        pieces = [(region, read_region(blocks, region, dtype, req.path)) for region in regions]
        put = ArrayPut(req.handle, req.layout.to_wire(), credential=req.credential,
                       pieces=codec.pieces_header(dtype, shape, pieces))
        error = self.store_own_put(put, pieces)
        if error:
            raise WireError(error)
        return Saved(sum(piece.nbytes for _, piece in pieces))
