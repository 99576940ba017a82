"""Checkpoints through the front end: the persistence programs of pathwaysutils and orbax
(``ENABLE_PATHWAYS_PERSISTENCE=1``). Each is an IFRT PluginProgram whose body is JSON, a
write request (executed with the arrays to write) or a read request (executed with none,
returning the arrays read), alone or in bulk; a part of the IFRT session (IfrtSession).
The workers write and read their own blocks (client/checkpoints.py), so no byte of an
array passes through the front end. ``location/name`` is the array's directory, read under
the workers' checkpoint directory (``--checkpoint-dir``; ``gs://`` names map into it)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pathways import errors
from pathways.ifrt import types as t
from pathways.ifrt.handling import IfrtArray, Lazy
from pathways.ifrt.types import IfrtError, Sharding
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.protocol import messages as m
from pathways.wire.codec import dtype_of_name

PLUGIN_PROGRAM = "xla::ifrt::PluginProgram"
PLUGIN_COMPILE_OPTIONS = "xla::ifrt::PluginCompileOptions"
_PREFIX = b"__serialized_plugin_program "
MAX_ARRAYS_PER_REQUEST = 1 << 16
# XLA's primitive type names, as a read request gives an array's dtype
_DTYPES = {"PRED": "bool", "S8": "int8", "S16": "int16", "S32": "int32", "S64": "int64", "U8": "uint8",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
           "F32": "float32", "F64": "float64", "C64": "complex64", "C128": "complex128"}


@dataclass(frozen=True)
class StoredArray:
    """One array of a persistence request: its directory, devices (IFRT ids, in the
    sharding's device-assignment order), sharding (an OpSharding, serialized), shape, dtype
    (read requests only) and timeout in seconds."""

    path: str
    devices: tuple[int, ...]
    op: bytes
    shape: tuple[int, ...]
    dtype: Optional[np.dtype]
    timeout: float


@dataclass(frozen=True)
class PersistenceProgram:
    """A compiled persistence request: write ``arrays`` (the execution's arguments) or read
    them (its outputs)."""

    write: bool
    arrays: tuple[StoredArray, ...]
    devices: tuple[int, ...]  # every device the request names, in first-named order


def plugin_request(data: bytes) -> tuple[str, Any]:
    """The kind of request a PluginProgram's serialized ``data`` holds, and the request
    (decoded JSON); IfrtError INVALID_ARGUMENT naming what is wrong."""
    if not data.startswith(_PREFIX):
        raise t.invalid("a plugin program must start with '__serialized_plugin_program '")
    try:
        body = json.loads(data[len(_PREFIX):])
    except (ValueError, UnicodeDecodeError) as e:
        raise t.invalid(f"the plugin program's body is not JSON ({e})") from None
    if not isinstance(body, dict) or len(body) != 1:
        raise t.invalid("a plugin program's body must be an object with one request")
    (kind, request), = body.items()
    return kind, request


def persistence_program(kind: str, request: Any, ndevices: int) -> PersistenceProgram:
    """The persistence program of a plugin program's request of ``kind`` (``plugin_request``);
    IfrtError INVALID_ARGUMENT naming what is wrong, UNIMPLEMENTED for another kind."""
    singles = {"persistenceWriteRequest": True, "persistenceReadRequest": False}
    bulks = {"bulk_persistence_write_request": ("write_requests", True),
             "bulk_persistence_read_request": ("read_requests", False)}
    if kind in singles:
        write, items = singles[kind], [request]
    elif kind in bulks:
        field, write = bulks[kind]
        items = request.get(field) if isinstance(request, dict) else None
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_ARRAYS_PER_REQUEST:
            raise t.invalid(f"{kind} needs a list {field!r} of 1 to {MAX_ARRAYS_PER_REQUEST} requests")
    else:
        raise IfrtError(t.UNIMPLEMENTED, f"plugin programs of kind {kind[:80]!r} are not supported; this server "
                                         "runs persistence write and read requests and profile requests")
    arrays = tuple(_stored(item, write, ndevices, f"{kind} request {i}") for i, item in enumerate(items))
    devices = tuple(dict.fromkeys(d for a in arrays for d in a.devices))
    return PersistenceProgram(write, arrays, devices)


def _stored(item: Any, write: bool, ndevices: int, what: str) -> StoredArray:
    if not isinstance(item, dict):
        raise t.invalid(f"{what} must be an object")
    location, name = _text(item, "b64_location", what), _text(item, "b64_name", what)
    if not name or name in (".", "..") or "/" in name:
        raise t.invalid(f"{what}: an array's name must be one path component, got {name[:80]!r}")
    devices = item.get("devices", {}).get("device_ids") if isinstance(item.get("devices"), dict) else None
    if (not isinstance(devices, list) or not devices or len(set(devices)) != len(devices)
            or not all(type(d) is int and 0 <= d < ndevices for d in devices)):
        raise t.invalid(f"{what}: devices.device_ids must name distinct devices among this session's {ndevices}")
    try:
        op = base64.b64decode(item.get("b64_hlo_sharding_string", ""), validate=True)
        t.op_of(op)
    except (binascii.Error, TypeError, ValueError, IfrtError):
        raise t.invalid(f"{what}: b64_hlo_sharding_string must be a base64 HloSharding") from None
    shape_field = item.get("shape")
    dtype = None
    if write:
        dims = shape_field
    else:
        dims = shape_field.get("dimensions") if isinstance(shape_field, dict) else None
        type_name = shape_field.get("xla_primitive_type_str") if isinstance(shape_field, dict) else None
        if type_name not in _DTYPES:
            raise t.invalid(f"{what}: shape.xla_primitive_type_str must be one of {sorted(_DTYPES)}")
        dtype = dtype_of_name(_DTYPES[type_name])
    if not isinstance(dims, list) or not all(type(d) is int and 0 <= d <= m.MAX_DIM for d in dims):
        raise t.invalid(f"{what}: the shape must be a list of dimensions")
    timeout = item.get("timeout", {})
    seconds = timeout.get("seconds", 0) + timeout.get("nanos", 0) / 1e9 if isinstance(timeout, dict) else 0
    if not isinstance(seconds, (int, float)) or not 0 < seconds:
        seconds = m.MAX_WAIT_SECONDS
    return StoredArray(os.path.join(location, name), tuple(devices), op, tuple(dims), dtype,
                       min(float(seconds), m.MAX_WAIT_SECONDS))


def _text(item: dict, field: str, what: str) -> str:
    try:
        text = base64.b64decode(item[field], validate=True).decode()
    except (KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise t.invalid(f"{what}: {field} must be base64 UTF-8 text") from None
    if not text and field == "b64_location":
        raise t.invalid(f"{what}: the location is empty")
    return text


class Persisting:
    """IfrtSession's compile and execute of persistence programs."""

    def _compile_persistence(self, kind: str, request: Any) -> pb.CompileResponse:
        program = persistence_program(kind, request, len(self._table))
        return self._compiled_program(program, "persistence", list(program.devices))

    def _execute_persistence(self, program: PersistenceProgram, body: Any) -> pb.LoadedExecutableExecuteResponse:
        if program.write:
            return self._write_arrays(program, body)
        outs = [self._read_array(a) for a in program.arrays]
        return self._executed(outs, body)

    def _write_arrays(self, program: PersistenceProgram, body: Any) -> pb.LoadedExecutableExecuteResponse:
        args = [self._array(h) for h in body.args_handles]
        if len(args) != len(program.arrays):
            raise t.invalid(f"the write request names {len(program.arrays)} arrays; {len(args)} were given")
        for i, (arr, stored) in enumerate(zip(args, program.arrays)):
            if arr.shape != stored.shape:
                raise t.invalid(f"argument {i} has shape {list(arr.shape)}; the write request says "
                                f"{list(stored.shape)}")
            if arr.parts:
                raise IfrtError(t.UNIMPLEMENTED, f"argument {i} is laid out across islands; save each island's "
                                                 "part as an array of its own")
        args = [self._real(a) for a in args]
        done = self._reads([h for a in args for h in a.handles])
        try:
            saves = [(stored, self.native.save_blocks(arr.place.addresses, arr.handle, arr.layout, arr.shape,
                                                      stored.path, stored.timeout))
                     for arr, stored in zip(args, program.arrays)]
        except BaseException:
            done()
            raise
        _when_all([f for _, f in saves], done)  # the arrays may be deleted once written

        def wait() -> None:
            deadline = time.monotonic() + max(s.timeout for s in program.arrays) + 60.0
            for stored, save in saves:
                try:
                    save.result(timeout=max(deadline - time.monotonic(), 0.0))
                except FutureTimeout:
                    raise IfrtError(t.DEADLINE_EXCEEDED, f"writing {stored.path} took longer than "
                                                         f"{stored.timeout:g} s") from None
                except errors.AccessDeniedError as e:
                    raise IfrtError(t.PERMISSION_DENIED, f"writing {stored.path} was refused: {e}") from None
                except errors.PathwaysError as e:
                    raise t.runtime_failure(e, f"writing {stored.path} failed: ") from None

        resp = pb.LoadedExecutableExecuteResponse()
        status = body.result_status_handle or self._server_handle()
        self._futures[status] = Lazy(wait)
        resp.status_handle = status
        return resp

    def _read_array(self, stored: StoredArray) -> IfrtArray:
        assert stored.dtype is not None
        sharding = Sharding(stored.devices, stored.op)
        if len(self._table.islands(sharding.devices)) > 1:
            raise IfrtError(t.UNIMPLEMENTED, f"reading {stored.path} onto devices of several islands is not "
                                             "supported; read it onto one island's devices")
        place, layout = self._table.layout(sharding, len(stored.shape))
        if layout.unreduced:
            raise t.invalid(f"{stored.path} cannot be read as an unreduced array")
        handle = self.native.allocate(1)
        moves = self.native.moves  # before the addresses: a move in between makes the controller drop it
        self.native.load_blocks(place.addresses, handle, layout, stored.dtype, stored.shape, stored.path, moves)
        return IfrtArray(stored.dtype, stored.shape, sharding, handle, layout, place)


def _when_all(futures: list[Future], then: Callable[[], None]) -> None:
    """Call ``then()`` once every one of ``futures`` is done, whatever its outcome."""
    left, lock = [len(futures)], threading.Lock()
    if not futures:
        then()
        return

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)
