"""Per-session memory quotas on a worker, and handing a closed session's memory back.

Each client session may hold at most ``limit`` bytes of arrays in a worker's object store
(``pathways worker --session-memory``; by default three quarters of the host's memory, so
that no one session takes a whole worker and the others keep serving). What counts is what
the store keeps for the session on this host: every device's buffer of each of its arrays
(a replicated array on 4 local devices counts 4 times, as it takes that much), whether it
came from a client's put, from the controller's IFRT front end, or from a run's outputs.
The controller's transfer copies (session 0) are not counted: a run takes each out of the
store as it reads it, so they live no longer than the run that reads them.

A put or a run's output that would take its session past the limit is refused with
``ResourceExhaustedError`` naming the limit, the session's usage and the request's size:
the put fails, and the output's handle holds that error instead of the array (its reader
gets it). The session goes on once it deletes arrays; other sessions never notice.

``SessionQuota`` is the accounting alone (no JAX, no threads): its caller holds a lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import re
from typing import Any, Optional


DEFAULT_FRACTION = 0.75  # of the host's memory a session may hold on a worker by default


def default_limit(host_memory: int) -> int:
    """The default quota of a worker whose host has ``host_memory`` bytes."""
    return int(host_memory * DEFAULT_FRACTION)


def parse_bytes(text: str) -> int:
    """A byte count from the command line: ``1073741824``, ``512M``, ``8G``, ``1.5GiB``
    (K, M, G, T are powers of 1024, with or without ``iB``/``B``), or ``none``/``0`` for
    no limit (0). ValueError saying what is accepted otherwise."""
    raw = text.strip().lower()
    if raw in ("none", "off", "unlimited"):
        return 0
    match = _SIZE.fullmatch(raw)
    if match is None:
        raise ValueError(f"{text!r} is not a size in bytes: give a number of bytes, optionally with K, M, G or T "
                         "(powers of 1024), e.g. 8G or 512M; or none for no limit")
    return int(float(match[1]) * _UNITS[match[2]])


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_text(nbytes: int) -> str:
    """``nbytes`` for a person: ``64.0 MiB (67108864 bytes)``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


class SessionQuota:
    """Bytes charged per session, against one limit for each (0: no limit, counted all the
    same, for the worker's stats). Not thread-safe: the object store calls it under its lock."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"a session memory limit is a number of bytes, 0 or more (0: none), got {limit}")
        self.limit = limit
        self._used: dict[int, int] = {}

    def refusal(self, session: int, nbytes: int, what: str) -> Optional[str]:
        """Why ``session`` may not take ``nbytes`` more for ``what`` ("a put of array
        0x..."), or None when it may (or there is no limit)."""
        used = self._used.get(session, 0)
        if not self.limit or used + nbytes <= self.limit:
            return None
        return (f"{what} needs {size_text(nbytes)} on this worker, but session {session} holds "
                f"{size_text(used)} here already and its quota is {size_text(self.limit)} per worker. Delete arrays "
                "this session no longer needs (arr.delete(), or drop the last reference to them), or have the "
                "operator raise the quota (`pathways worker --session-memory BYTES`, `pathways up --session-memory`, "
                "pw.local_cluster(session_memory=...))")

    def charge(self, session: int, nbytes: int) -> None:
        if nbytes:
            self._used[session] = self._used.get(session, 0) + nbytes

    def release(self, session: int, nbytes: int) -> None:
        if not nbytes:
            return
        left = self._used.get(session, 0) - nbytes
        if left > 0:
            self._used[session] = left
        else:
            self._used.pop(session, None)

    def drop(self, session: int) -> int:
        """Forget ``session``'s charges; returns how many bytes it held."""
        return self._used.pop(session, 0)

    def used(self, session: int) -> int:
        return self._used.get(session, 0)

    def usage(self) -> dict[int, int]:
        """Bytes held by each session that holds any."""
        return dict(self._used)


def held_bytes(value: Any) -> int:
    """The bytes ``value`` (a jax.Array, or anything with ``nbytes``) takes on this host's
    devices: each addressable device's shard. Cached per sharding object and (shape, dtype):
    a run's every output is counted, and hashing a sharding costs more than the rest of
    storing a small output (the cache holds each sharding it names, so ids are not reused)."""
    sharding = getattr(value, "sharding", None)
    if sharding is None:
        return int(getattr(value, "nbytes", 0) or 0)
    entry = _BY_SHARDING.get(id(sharding))
    if entry is None or entry[0] is not sharding:
        entry = (sharding, {})
        if len(_BY_SHARDING) < _MAX_CACHED:
            _BY_SHARDING[id(sharding)] = entry
    sizes = entry[1]
    key = (value.shape, value.dtype)
    nbytes = sizes.get(key)
    if nbytes is None:
        nbytes = layout_bytes.__wrapped__(sharding, tuple(value.shape), value.dtype)
        if len(sizes) < _MAX_CACHED:
            sizes[key] = nbytes
    return nbytes


_MAX_CACHED = 4096  # shardings, and (shape, dtype) per sharding: the wire names them, so they are bounded
_BY_SHARDING: dict[int, tuple[Any, dict]] = {}


@functools.lru_cache(maxsize=4096)
def layout_bytes(sharding: Any, shape: tuple[int, ...], dtype: Any) -> int:
    """The bytes an array of ``shape`` and ``dtype`` (numpy's) laid out as ``sharding``
    takes on this host's devices."""
    shard = sharding.shard_shape(shape)
    return math.prod(shard) * dtype.itemsize * len(sharding.addressable_devices)


_LIBC: Any = None


def release_memory() -> bool:
    """Collect garbage and hand the memory malloc keeps free back to the system
    (glibc's ``malloc_trim(0)``), so that a worker's resident memory falls once a session's
    arrays and executables are gone, instead of staying at its peak for the next arrays of
    the same sizes. False where the C library has no malloc_trim (not glibc)."""
    global _LIBC
    gc.collect()
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
