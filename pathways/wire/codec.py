"""msgpack encoding, and arrays on the wire: headers, raw chunks, pieces of sharded arrays.

Control messages are typed (pathways/protocol); what is here carries array bytes: the
headers of puts, fetch replies and data-plane frames, checked on receipt, and the raw
buffers that follow them, never pickled.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

import msgpack
import numpy as np

from pathways.errors import WireError

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # one gRPC payload
CHUNK_BYTES = 4 * 1024 * 1024

# ml_dtypes' types that jax.numpy names (numpy alone has none): one byte per element in
# memory and on the wire, the sub-byte ones too (XLA packs them on the device)
ML_DTYPES = ("bfloat16 int2 uint2 int4 uint4 float4_e2m1fn float8_e3m4 float8_e4m3 float8_e4m3fn "
             "float8_e4m3b11fnuz float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu").split()
# dtypes that may cross the wire, in jax.numpy's names; anything else (object, void, ...) is refused.
WIRE_DTYPES = ("bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
               "complex64 complex128").split() + ML_DTYPES
_WIRE_DTYPES = frozenset(WIRE_DTYPES)


def is_wire_dtype(dtype: np.dtype) -> bool:
    return dtype_name(dtype) in _WIRE_DTYPES


def dtype_name(dtype: Any) -> str:
    """``np.dtype(dtype).name``, remembered: numpy derives it in Python at each call, and
    every array header on the wire names its dtype."""
    name = _NAMES.get(dtype)
    if name is None:
        name = np.dtype(dtype).name
        if len(_NAMES) < 256:  # dtypes and their spellings are few; a bound all the same
            _NAMES[dtype] = name
    return name


_NAMES: dict[Any, str] = {}


def is_wire_dtype_name(name: object) -> bool:
    return isinstance(name, str) and name in _WIRE_DTYPES  # a list or map is unhashable


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Each thread's reused packer (``pack_each``), and the size of object past which it is let go:
# a packer keeps the largest buffer it has grown to (a function's blob may be 64 MiB).
_PACKERS = threading.local()
_KEPT_PACKER_BYTES = 1 << 20


def pack_each(obj: Any) -> bytes:
    """``pack(obj)`` with a packer this thread reuses, for the many small objects packed one
    by one (each message of a batch): ``pack`` makes a packer per call, which costs about as
    much as packing a small object."""
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    packed = packer.pack(obj)
    if len(packed) > _KEPT_PACKER_BYTES:
        _PACKERS.packer = None
    return packed


def list_header(length: int) -> bytes:
    """The msgpack header of a list of ``length`` items, in the smallest form, as ``pack``
    writes it: ``pack(items)`` is this followed by ``pack(item)`` for each item."""
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


# msgpack decodes some 10 to 20 million small values a second while holding the GIL, so a
# payload of tens of MB of small values (a program of a million nodes is 33 MB) would stop its
# whole process for seconds: a controller would miss its heartbeats and its workers give it
# up. No message needs more than MAX_DECODED_VALUES values in its lists and maps; a payload of
# fewer bytes cannot hold more (each value takes at least a byte), and a larger one is decoded
# counting them, and refused once past the bound, having decoded at most that many and one list.
MAX_DECODED_VALUES = 1 << 21


class _Budget:
    """The list and map hooks of a counted decode: each container counts itself and its entries."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_DECODED_VALUES

    def take(self, container: Any) -> Any:
        self.left -= len(container) + 1
        if self.left < 0:
            raise WireError(f"the payload holds more than {MAX_DECODED_VALUES} values in its lists and maps, more "
                            "than any message needs; send smaller messages (a program of at most 65536 nodes, "
                            "fewer handles at once)")
        return container


def unpack(data: bytes) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a payload of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        if len(data) <= MAX_DECODED_VALUES:
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
        budget = _Budget()
        return msgpack.unpackb(data, raw=False, strict_map_key=False, list_hook=budget.take,
                               object_hook=budget.take, max_array_len=MAX_DECODED_VALUES,
                               max_map_len=MAX_DECODED_VALUES)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"payload is not valid msgpack ({type(e).__name__}: {e})") from None


def int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WireError(f"{what} must be a list of integers")
    return value


# ---- arrays -------------------------------------------------------------------------

MAX_RANK = 64  # numpy's own limit on dimensions
MAX_PIECES = 4096  # pieces of one array a sender may announce: more than any host holds
_ALIGN = 64  # XLA's CPU client adopts host buffers aligned like this instead of copying them
_ALIGN_FROM = 4096  # smaller arrays are left for XLA to copy


# The container's memory limit (cgroup v2, then v1), where one is set and below the host's.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@functools.cache
def host_memory_bytes() -> int:
    """The memory this process's host can use, in bytes: its physical memory, or the
    container's limit where that is lower. No array announced larger than it can be stored
    here, and a worker reports it as its CPU devices' memory. Read once: every array header
    is checked against it, and each read is a system call."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            return min(physical, int(raw))
    return physical


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array, aligned for XLA unless it is small. np.empty maps large
    buffers without touching them, so memory is committed page by page as data is written
    into it, never up front; a large buffer that an earlier array of the same size no
    longer uses is used again (``_Recycler``)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _ALIGN_FROM:  # copying it costs XLA less than aligning it costs here
        return np.empty(shape, dtype)
    return _RECYCLER.take(nbytes + _ALIGN, lambda raw: _aligned_view(raw, nbytes, dtype, shape),
                          f"an incoming {dtype}{list(shape)} array")


def _aligned_view(raw: np.ndarray, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class _Recycler:
    """The last few large receive buffers, each used again once no array uses it.

    A fresh buffer costs the kernel's zeroing of every page on first write, about as much
    as the copy into it; transfers of one size tend to repeat (a batch each training step,
    the same array read again), and the arrays of the last one are often gone by then.
    A buffer is free when nothing but this list refers to it: every view of it (an
    array, a device buffer that adopted it) holds a reference to it. At most ``KEEP``
    buffers of ``MIN_BYTES`` to ``MAX_BYTES`` are remembered, so at most KEEP * MAX_BYTES
    stay allocated for reuse after their arrays are gone."""

    MIN_BYTES = 1 << 20
    MAX_BYTES = 128 << 20
    KEEP = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []  # oldest first
        self._idle = self._references([np.empty(0, np.uint8)])[0]

    @staticmethod
    def _references(buffers: list[np.ndarray]) -> list[int]:
        """The reference counts of ``buffers`` seen from here: a buffer nothing else uses
        has as many as the probe in ``__init__`` (this list's, the loop's, the call's)."""
        return [sys.getrefcount(raw) for raw in buffers]

    def take(self, size: int, view: Callable[[np.ndarray], np.ndarray], what: str) -> np.ndarray:
        """``view`` of a free remembered buffer of ``size`` bytes, or of a new one."""
        recycle = self.MIN_BYTES <= size <= self.MAX_BYTES
        if recycle:
            with self._lock:  # the view is made inside: another taker then sees the buffer in use
                for raw, refs in zip(self._buffers, self._references(self._buffers)):
                    if raw.nbytes == size and refs == self._idle:
                        return view(raw)
        try:
            raw = np.empty(size, np.uint8)
        except (MemoryError, ValueError) as e:
            raise WireError(f"cannot allocate {size} bytes for {what} ({type(e).__name__}); send it in smaller "
                            "pieces or free memory on this host") from None
        result = view(raw)
        if recycle:
            with self._lock:
                self._buffers.append(raw)
                del self._buffers[:-self.KEEP]
        return result


_RECYCLER = _Recycler()


def array_header(arr: np.ndarray) -> dict:
    return _spec(arr.dtype, arr.shape)


def check_array_header(header: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    """The dtype, shape and size an array header announces; WireError for anything else,
    whatever the types inside it, and for a size larger than this host's memory."""
    if not isinstance(header, dict):
        raise WireError("array header must be a map")
    dtype, shape, nbytes = header.get("dtype"), header.get("shape"), header.get("nbytes")
    if not is_wire_dtype_name(dtype):
        raise WireError(f"array dtype {brief(dtype)} is not allowed on the wire; "
                        f"use one of {sorted(_WIRE_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise WireError(f"array shape must be a list of at most {MAX_RANK} sizes, got {brief(shape)}")
    shape = int_list(shape, "array shape")
    if any(d < 0 for d in shape):
        raise WireError(f"array shape {shape} has a negative size")
    np_dtype = dtype_of_name(dtype)
    expect = math.prod(shape) * np_dtype.itemsize
    if nbytes != expect or isinstance(nbytes, bool):
        raise WireError(f"array header says {brief(nbytes)} bytes but {dtype}{shape} needs {expect}")
    limit = host_memory_bytes()
    if expect > limit:
        raise WireError(f"a {dtype}{shape} array of {expect} bytes exceeds this host's {limit} bytes of "
                        f"memory; shard it over more hosts")
    return np_dtype, tuple(shape), expect


def brief(value: Any) -> str:
    """A hostile value's repr, cut short for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dtype_of_name(name: str) -> np.dtype:
    """The numpy dtype a wire dtype name stands for (ml_dtypes' types among them), remembered."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        if name in ML_DTYPES:
            import ml_dtypes

            dtype = np.dtype(getattr(ml_dtypes, name))
        else:
            dtype = np.dtype(name)
        _DTYPES[name] = dtype  # at most one per wire dtype
    return dtype


_DTYPES: dict[str, np.dtype] = {}


def array_chunks(arr: np.ndarray) -> Iterator[bytes]:
    """The raw bytes of ``arr`` in C order, in chunks of at most CHUNK_BYTES (of at least
    one element). A strided view (a transpose, a broadcast with stride 0) is laid out in C
    order one chunk at a time, never whole: a view of a few bytes may stand for gigabytes."""
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, CHUNK_BYTES):
            yield flat[start:start + CHUNK_BYTES].tobytes()
        return
    yield from _strided_chunks(arr)


def _strided_chunks(arr: np.ndarray) -> Iterator[bytes]:
    """``array_chunks`` of an array that is not C-contiguous: as many whole rows (blocks
    of the first dimension) as fit in a chunk, each gathered by ``tobytes`` (one copy of
    the chunk's bytes); a row larger than a chunk is cut the same way, one dimension down."""
    if arr.ndim == 0 or arr.size == 0:
        if arr.size:
            yield arr.tobytes()
        return
    row = arr.nbytes // arr.shape[0]
    if row > CHUNK_BYTES:
        for i in range(arr.shape[0]):
            yield from _strided_chunks(arr[i])
        return
    rows = CHUNK_BYTES // row
    for start in range(0, arr.shape[0], rows):
        yield arr[start:start + rows].tobytes()


def assemble_array(header: Any, chunks: Iterable[bytes]) -> np.ndarray:
    """Rebuild an array from its header and the next raw chunks of ``chunks``, consuming
    exactly the bytes the header announced (pass an iterator to read several in turn).
    The array is aligned for XLA, and its memory is committed only as chunks arrive: a
    header announcing gigabytes followed by a few bytes costs a few pages, not gigabytes."""
    dtype, shape, nbytes = check_array_header(header)
    array = aligned_empty(shape, dtype)
    flat = array.reshape(-1).view(np.uint8)
    pos = 0
    for chunk in exact_chunks(nbytes, chunks):
        flat[pos:pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
        pos += len(chunk)
    return array


def exact_chunks(nbytes: int, chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The next raw chunks of ``chunks`` holding exactly ``nbytes`` bytes, checked:
    WireError for fewer, for more, or for a chunk that is not binary."""
    chunks = iter(chunks)
    pos = 0
    while pos < nbytes:
        chunk = next(chunks, None)
        if chunk is None:
            raise WireError(f"array data has {pos} bytes, header announced {nbytes}")
        if not isinstance(chunk, (bytes, bytearray)):
            raise WireError("array chunk must be binary")
        if pos + len(chunk) > nbytes:
            raise WireError(f"array data exceeds the {nbytes} bytes its header announced")
        pos += len(chunk)
        yield chunk


def expect_end(chunks: Iterable[bytes]) -> None:
    if next(iter(chunks), None) is not None:
        raise WireError("more array data arrived than the headers announced")


# ---- pieces: the parts of a sharded array one host holds -------------------------------

# The block of an array a device holds, or a piece of one: (start, stop) per dimension. The
# one name for it: the IR, the controller, the workers and the IFRT front end all use this.
Region = tuple[tuple[int, int], ...]
Piece = tuple[Region, np.ndarray]


def full_region(shape: tuple[int, ...]) -> Region:
    return tuple((0, d) for d in shape)


def pieces_header(dtype: np.dtype, shape: tuple[int, ...], pieces: list[Piece]) -> dict:
    """Header fields describing ``pieces`` of an array of ``dtype`` and ``shape``."""
    return {"array": _spec(dtype, shape),
            "pieces": [{"index": [list(i) for i in index], "array": array_header(a)} for index, a in pieces]}


def whole_array_header(dtype: np.dtype, shape: tuple[int, ...]) -> dict:
    """Header fields of an array of ``dtype`` and ``shape`` sent as one piece, the whole of it."""
    spec = _spec(dtype, shape)
    return {"array": spec, "pieces": [{"index": [list(i) for i in full_region(shape)], "array": spec}]}


def _spec(dtype: np.dtype, shape: tuple[int, ...]) -> dict:
    return {"dtype": dtype_name(dtype), "shape": list(shape), "nbytes": math.prod(shape) * np.dtype(dtype).itemsize}


def pieces_chunks(pieces: list[Piece]) -> Iterator[bytes]:
    for _, a in pieces:
        yield from array_chunks(a)


def piece_specs(header: Any) -> tuple[np.dtype, tuple[int, ...], list[tuple[Region, tuple[int, ...]]]]:
    """The full array's dtype and shape and each announced piece's (index, shape), checked:
    WireError for any other shape of header, at most MAX_PIECES pieces."""
    if not isinstance(header, dict):
        raise WireError("an array's header must be a map")
    dtype, shape, _ = check_array_header(header.get("array"))
    raw = header.get("pieces")
    if not isinstance(raw, list) or len(raw) > MAX_PIECES:
        raise WireError(f"array pieces must be a list of at most {MAX_PIECES}; send more in separate puts")
    specs = []
    for p in raw:
        if not isinstance(p, dict) or not isinstance(p.get("index"), list) or len(p["index"]) != len(shape):
            raise WireError(f"an array piece needs an index of {len(shape)} [start, stop] pairs")
        index = tuple(tuple(int_list(i, "piece index")) for i in p["index"])
        if any(len(i) != 2 or not 0 <= i[0] <= i[1] <= d for i, d in zip(index, shape)):
            raise WireError(f"piece index {brief(p['index'])} does not fit array shape {list(shape)}")
        piece_dtype, piece_shape, _ = check_array_header(p.get("array"))
        if piece_dtype != dtype or piece_shape != tuple(b - a for a, b in index):
            raise WireError(f"piece {piece_dtype}{list(piece_shape)} does not match its index {brief(p['index'])}")
        specs.append((index, piece_shape))
    return dtype, shape, specs


def read_pieces(header: dict, chunks: Iterator[bytes]) -> tuple[np.dtype, tuple[int, ...], list[Piece]]:
    """The full array's dtype and shape and the pieces that follow ``header``, checked."""
    dtype, shape, specs = piece_specs(header)
    chunks = iter(chunks)
    pieces = [(index, assemble_array(p["array"], chunks)) for (index, _), p in zip(specs, header["pieces"])]
    return dtype, shape, pieces


def intersect(a: Region, b: Region) -> Region | None:
    """The common part of two blocks, or None. Blocks of an empty dimension are all (0, 0)
    and meet each other, so that empty arrays still have their (empty) pieces."""
    out = []
    for (x0, x1), (y0, y1) in zip(a, b):
        lo, hi = max(x0, y0), min(x1, y1)
        if not (lo < hi or x0 == x1 == y0 == y1):
            return None
        out.append((lo, hi))
    return tuple(out)


def volume(index: Region) -> int:
    return math.prod(hi - lo for lo, hi in index)


def _window(inner: Region, outer: Region) -> tuple[slice, ...]:
    """``inner`` in the coordinates of the block ``outer`` that contains it."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def _view(array: np.ndarray, inner: Region, outer: Region) -> np.ndarray:
    # indexing a 0-d array with () gives a numpy scalar, not an array
    return array if inner == outer else array[_window(inner, outer)]


def cut(pieces: list[Piece], region: Region) -> np.ndarray:
    """The part ``region`` of an array from the piece that contains it (a view)."""
    for index, array in pieces:
        if all(a <= r0 and r1 <= b for (a, b), (r0, r1) in zip(index, region)):
            return _view(array, region, index)
    raise WireError(f"no piece held here contains region {[list(r) for r in region]}")


class Assembly:
    """Collects the pieces of the ``regions`` of an array (default: all of it) that one
    or more senders deliver, until every region is complete. Pieces of a sharded array
    are blocks of one grid, so two pieces are either identical (replicas, kept once) or
    disjoint, and counting elements tells when a region is complete."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], regions: list[Region] | None = None) -> None:
        self.dtype, self.shape = dtype, shape
        self.regions = [full_region(shape)] if regions is None else list(regions)
        self._buffers: dict[Region, np.ndarray] = {}
        self._missing = {r: volume(r) for r in self.regions}
        self._seen: set[Region] = set()

    def add(self, pieces: list[Piece]) -> None:
        for index, array in pieces:
            if index in self._seen:
                continue
            self._seen.add(index)
            for region in self.regions:
                common = intersect(index, region)
                if common is None:
                    continue
                if common == region and region not in self._buffers:
                    self._buffers[region] = _view(array, region, index)  # no copy
                else:
                    buf = self._buffers.get(region)
                    if buf is None:
                        buf = self._buffers[region] = np.empty(tuple(b - a for a, b in region), self.dtype)
                    buf[_window(common, region)] = _view(array, common, index)
                self._missing[region] -= volume(common)

    @property
    def complete(self) -> bool:
        return not any(self._missing.values()) and len(self._buffers) == len(self.regions)

    def region(self, index: Region) -> np.ndarray:
        if not self.complete:
            raise WireError(f"the pieces received do not cover the {self.dtype}{list(self.shape)} array's "
                            f"regions {[[list(i) for i in r] for r in self.regions]}")
        return self._buffers[index]

    def result(self) -> np.ndarray:
        """The whole array (for an assembly of the default region)."""
        return self.region(full_region(self.shape))
