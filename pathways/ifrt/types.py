"""Pure translations between the IFRT proxy's protobuf forms and plain values.

dtypes, shapes, shardings (device ids plus an xla OpSharding), byte strides and status
protos. Nothing here talks to a network or to a session. Every proto built here sets the
IFRT ``version_number`` fields to 0: the jaxlib client fails to decode anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pathways.errors import AccessDeniedError, DeadlineExceededError, ResourceExhaustedError, WireError, WorkerLostError
from pathways.hlo import row_major, tile_assignment
from pathways.proto.xla import xla_data_pb2
from pathways.proto.xla.python.ifrt import dtype_pb2, serdes_pb2, sharding_pb2, sharding_serdes_pb2, shape_pb2
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2
from pathways.proto.xla.python.pjrt_ifrt import xla_sharding_pb2
from pathways.proto.xla.tsl.protobuf import error_codes_pb2
from pathways.wire.codec import Region, dtype_of_name, is_wire_dtype

# Status codes (tensorflow.error.Code) the server answers with.
INVALID_ARGUMENT = error_codes_pb2.INVALID_ARGUMENT
NOT_FOUND = error_codes_pb2.NOT_FOUND
UNIMPLEMENTED = error_codes_pb2.UNIMPLEMENTED
FAILED_PRECONDITION = error_codes_pb2.FAILED_PRECONDITION
RESOURCE_EXHAUSTED = error_codes_pb2.RESOURCE_EXHAUSTED
DEADLINE_EXCEEDED = error_codes_pb2.DEADLINE_EXCEEDED
INTERNAL = error_codes_pb2.INTERNAL
UNAVAILABLE = error_codes_pb2.UNAVAILABLE
PERMISSION_DENIED = error_codes_pb2.PERMISSION_DENIED
UNAUTHENTICATED = error_codes_pb2.UNAUTHENTICATED
DATA_LOSS = error_codes_pb2.DATA_LOSS

SERVER_HANDLE_BASE = 1 << 48  # handles the server makes: never among the client's small ones
MEMORY_KIND = "device"
HLO_SHARDING = "xla::ifrt::HloSharding"
SINGLE_DEVICE_SHARDING = "xla::ifrt::SingleDeviceSharding"
CONCRETE_EVEN_SHARDING = "xla::ifrt::ConcreteEvenSharding"
MAX_RANK = 64
MAX_ELEMENTS = 1 << 40


class IfrtError(Exception):
    """A request failed: answered with this status code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> IfrtError:
    return IfrtError(INVALID_ARGUMENT, message)


def runtime_failure(e: Exception, what: str = "") -> IfrtError:
    """The IfrtError for the error ``e`` of a request: DATA_LOSS where a host was lost with
    what it held (JAX tooling, pathwaysutils' elastic manager among it, takes DATA_LOSS for
    a slice that went down), DEADLINE_EXCEEDED where a run outlasted the run timeout and
    its island was reset, RESOURCE_EXHAUSTED where a worker would not hold more for the
    session (its memory quota), PERMISSION_DENIED where a worker refused what its operator
    did not allow, INTERNAL otherwise."""
    code = (DATA_LOSS if isinstance(e, WorkerLostError) else
            DEADLINE_EXCEEDED if isinstance(e, DeadlineExceededError) else
            RESOURCE_EXHAUSTED if isinstance(e, ResourceExhaustedError) else
            PERMISSION_DENIED if isinstance(e, AccessDeniedError) else INTERNAL)
    return IfrtError(code, f"{what}{type(e).__name__}: {e}")


# ---- dtypes and shapes ---------------------------------------------------------------------

_K = dtype_pb2.DTypeProto
_NAME_OF_KIND = {_K.KIND_PRED: "bool", _K.KIND_S8: "int8", _K.KIND_S16: "int16", _K.KIND_S32: "int32",
                 _K.KIND_S64: "int64", _K.KIND_U8: "uint8", _K.KIND_U16: "uint16", _K.KIND_U32: "uint32",
                 _K.KIND_U64: "uint64", _K.KIND_F16: "float16", _K.KIND_F32: "float32", _K.KIND_F64: "float64",
                 _K.KIND_BF16: "bfloat16", _K.KIND_C64: "complex64", _K.KIND_C128: "complex128",
                 _K.KIND_S2: "int2", _K.KIND_U2: "uint2", _K.KIND_S4: "int4", _K.KIND_U4: "uint4",
                 _K.KIND_F4E2M1FN: "float4_e2m1fn", _K.KIND_F8E3M4: "float8_e3m4", _K.KIND_F8E4M3: "float8_e4m3",
                 _K.KIND_F8E4M3FN: "float8_e4m3fn", _K.KIND_F8E4M3B11FNUZ: "float8_e4m3b11fnuz",
                 _K.KIND_F8E4M3FNUZ: "float8_e4m3fnuz", _K.KIND_F8E5M2: "float8_e5m2",
                 _K.KIND_F8E5M2FNUZ: "float8_e5m2fnuz", _K.KIND_F8E8M0FNU: "float8_e8m0fnu"}
_KIND_OF_NAME = {v: k for k, v in _NAME_OF_KIND.items()}


def dtype_of(proto: dtype_pb2.DTypeProto) -> np.dtype:
    name = _NAME_OF_KIND.get(proto.kind)
    if name is None:
        kind = _K.Kind.Name(proto.kind) if proto.kind in _K.Kind.values() else str(proto.kind)
        raise IfrtError(UNIMPLEMENTED, f"arrays of dtype {kind} are not supported by this server; use one of "
                                       f"{sorted(_KIND_OF_NAME)}")
    return dtype_of_name(name)


def dtype_proto(dtype: np.dtype | str) -> dtype_pb2.DTypeProto:
    if not isinstance(dtype, str) and np.dtype(dtype).kind == "T":  # numpy's StringDType
        return dtype_pb2.DTypeProto(kind=_K.KIND_STRING, version_number=0)
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _KIND_OF_NAME or not is_wire_dtype(dtype_of_name(name)):
        raise IfrtError(UNIMPLEMENTED, f"dtype {name} has no IFRT form here")
    return dtype_pb2.DTypeProto(kind=_KIND_OF_NAME[name], version_number=0)


def string_host_buffer(value: np.ndarray) -> bytes:
    """A string array's host buffer as the IFRT proxy protocol carries it: a serialized
    ``StringArrayContents`` (field 1: each string's bytes, in C order)."""
    out = bytearray()
    for element in np.asarray(value).reshape(-1):
        raw = str(element).encode()
        out += b"\x0a" + varint(len(raw)) + raw
    return bytes(out)


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint, for the messages encoded by hand."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def shape_of(dims: Sequence[int], what: str = "shape") -> tuple[int, ...]:
    dims = tuple(int(d) for d in dims)
    if len(dims) > MAX_RANK or any(d < 0 for d in dims) or math.prod(dims) > MAX_ELEMENTS:
        raise invalid(f"{what} {list(dims)[:8]} is not a shape of at most {MAX_RANK} non-negative sizes "
                      f"and {MAX_ELEMENTS} elements")
    return dims


def shape_proto(shape: Sequence[int]) -> shape_pb2.ShapeProto:
    return shape_pb2.ShapeProto(dims=list(shape), version_number=0)


def default_layout_text(ndim: int) -> bytes:
    """The default (row-major) layout in the text form the client parses, e.g. ``{1,0}``."""
    return ("{" + ",".join(str(d) for d in row_major(ndim)) + "}").encode()


# ---- shardings -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sharding:
    """An IFRT sharding as the server keeps it: the IFRT ids of its devices and an xla
    OpSharding (serialized) over their positions 0..n-1."""

    devices: tuple[int, ...]
    op: bytes

    @property
    def replicated(self) -> bool:
        return is_replicated(self.op, len(self.devices))


_REPLICATED = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.REPLICATED).SerializeToString()


def replicated(devices: Sequence[int]) -> Sharding:
    return Sharding(tuple(devices), _REPLICATED)


def op_of(op: bytes) -> xla_data_pb2.OpSharding:
    try:
        return xla_data_pb2.OpSharding.FromString(op)
    except Exception as e:  # protobuf raises DecodeError and others on garbage
        raise invalid(f"the sharding's OpSharding does not parse ({type(e).__name__})") from None


def is_replicated(op: bytes, ndevices: int) -> bool:
    o = op_of(op)
    if o.type == o.REPLICATED or (o.type == o.MAXIMAL and ndevices == 1):
        return True
    if o.type == o.OTHER:
        dims = list(o.tile_assignment_dimensions)
        return o.replicate_on_last_tile_dim and math.prod(dims[:-1]) == 1
    return False


def is_unreduced(op: bytes) -> bool:
    """Whether devices of this OpSharding hold partial values to be summed (UNREDUCED)."""
    o = op_of(op)
    return o.type == o.UNREDUCED or o.UNREDUCED in o.last_tile_dims


def parse_sharding(proto: sharding_pb2.ShardingProto, ndevices_known: int) -> Sharding:
    """The sharding a client sent; ``ndevices_known``: how many devices the session has
    (every id must be below it)."""
    serialized = proto.serialized_sharding
    kind = serialized.type_name
    try:
        if kind == HLO_SHARDING:
            hlo = xla_sharding_pb2.HloShardingProto.FromString(serialized.data)
            devices = tuple(hlo.devices.device_ids)
            op = hlo.xla_op_sharding.SerializeToString()
        elif kind == SINGLE_DEVICE_SHARDING:
            single = sharding_serdes_pb2.SingleDeviceShardingProto.FromString(serialized.data)
            devices, op = (single.device_id,), _REPLICATED
        elif kind == CONCRETE_EVEN_SHARDING:
            even = sharding_serdes_pb2.ConcreteEvenShardingProto.FromString(serialized.data)
            devices = tuple(even.devices.device_ids)
            if not (even.is_fully_replicated or len(devices) == 1):
                raise IfrtError(UNIMPLEMENTED, "a ConcreteEvenSharding that is not fully replicated is not "
                                               "supported; use a NamedSharding")
            op = _REPLICATED
        else:
            raise IfrtError(UNIMPLEMENTED, f"sharding type {kind[:80]!r} is not supported by this server; "
                                           f"it takes {HLO_SHARDING}, {SINGLE_DEVICE_SHARDING} and "
                                           f"{CONCRETE_EVEN_SHARDING}")
    except IfrtError:
        raise
    except Exception as e:
        raise invalid(f"the {kind[:80]} sharding does not parse ({type(e).__name__})") from None
    return Sharding(_checked_devices(devices, ndevices_known), op)


def _checked_devices(devices: tuple[int, ...], ndevices_known: int) -> tuple[int, ...]:
    if not devices:
        raise invalid("a sharding needs at least one device")
    if len(set(devices)) != len(devices) or any(not 0 <= d < ndevices_known for d in devices):
        raise invalid(f"sharding devices {list(devices)[:16]} must be distinct ids of this session's "
                      f"{ndevices_known} devices (jax.devices())")
    return devices


def even_devices(proto: sharding_pb2.ShardingProto, ndevices_known: int) -> Optional[tuple[int, ...]]:
    """The devices of ``proto`` when it is a ConcreteEvenSharding that is not fully
    replicated, else None. Such a sharding says that each device holds an even block, not
    which one; the client sends it for the arrays a remap makes (``jax.device_put`` to a
    mesh of the same devices in another order), whose shards say which."""
    serialized = proto.serialized_sharding
    if serialized.type_name != CONCRETE_EVEN_SHARDING:
        return None
    try:
        even = sharding_serdes_pb2.ConcreteEvenShardingProto.FromString(serialized.data)
    except Exception as e:
        raise invalid(f"the {CONCRETE_EVEN_SHARDING} sharding does not parse ({type(e).__name__})") from None
    devices = tuple(even.devices.device_ids)
    if even.is_fully_replicated or len(devices) == 1:
        return None
    return _checked_devices(devices, ndevices_known)


def relabelled(sharding: Sharding, devices: Sequence[int], source: Sequence[int]) -> Sharding:
    """``sharding``'s blocks on ``devices``: device j holds the block that the device at
    position ``source[j]`` of ``sharding`` holds (``source``: a permutation of them)."""
    n = len(sharding.devices)
    if len(devices) != n or sorted(source) != list(range(n)):
        raise invalid(f"the remapped shards {list(source)[:16]} are not each of the array's {n} shards once, "
                      f"for {len(devices)} devices")
    o = op_of(sharding.op)
    if o.type != o.OTHER:  # replicated or on one device: the blocks are the whole array
        return Sharding(tuple(devices), sharding.op)
    position = {p: j for j, p in enumerate(source)}
    out = xla_data_pb2.OpSharding()
    out.CopyFrom(o)
    del out.iota_reshape_dims[:], out.iota_transpose_perm[:]
    out.tile_assignment_devices[:] = [position[p] for p in tile_devices(o, n)]
    return Sharding(tuple(devices), out.SerializeToString())


def sharding_proto(sharding: Sharding) -> sharding_pb2.ShardingProto:
    hlo = xla_sharding_pb2.HloShardingProto(version_number=0, memory_kind=MEMORY_KIND)
    hlo.devices.version_number = 0
    hlo.devices.device_ids.extend(sharding.devices)
    hlo.xla_op_sharding.CopyFrom(op_of(sharding.op))
    return sharding_pb2.ShardingProto(serialized_sharding=serdes_pb2.Serialized(
        type_name=HLO_SHARDING, data=hlo.SerializeToString()))


def shard_regions(sharding: Sharding, shape: tuple[int, ...]) -> list[Region]:
    """The block of the array each device of ``sharding`` holds, in device order (an
    unreduced array's devices hold partial values of their blocks). IfrtError for
    shardings this server cannot cut (MANUAL, manual subgroups)."""
    n = len(sharding.devices)
    full = tuple((0, d) for d in shape)
    o = op_of(sharding.op)
    if sharding.replicated or o.type == o.UNREDUCED:
        return [full] * n
    partial = {o.REPLICATED, o.UNREDUCED}
    if o.type != o.OTHER or not set(o.last_tile_dims) <= partial:
        name = xla_data_pb2.OpSharding.Type.Name(o.type) if o.type in xla_data_pb2.OpSharding.Type.values() else "?"
        raise IfrtError(UNIMPLEMENTED, f"an OpSharding of type {name} with subgroups "
                                       f"{[xla_data_pb2.OpSharding.Type.Name(k) for k in o.last_tile_dims]} "
                                       "cannot be cut into shards here; only replicated and unreduced ones can")
    dims = list(o.tile_assignment_dimensions)
    subgroups = len(o.last_tile_dims) or int(o.replicate_on_last_tile_dim)
    tiled = dims[:len(dims) - subgroups]
    if len(tiled) != len(shape) or math.prod(dims) != n:
        raise invalid(f"OpSharding tile dims {dims} do not fit a rank-{len(shape)} array on {n} devices")
    order = tile_devices(o, n)
    regions: list[Optional[Region]] = [None] * n
    for flat, device in enumerate(order):
        coords = np.unravel_index(flat, dims)
        block = []
        for axis, (size, tiles) in enumerate(zip(shape, tiled)):
            step = -(-size // tiles)
            lo = min(int(coords[axis]) * step, size)
            block.append((lo, min(lo + step, size)))
        regions[device] = tuple(block)
    return regions  # type: ignore[return-value]  # every entry set: the tile order is a permutation


def island_part(sharding: Sharding, shape: tuple[int, ...], positions: Sequence[int]) -> tuple[Region, Sharding]:
    """What the devices at ``positions`` of ``sharding`` (one island's) hold of an array
    of ``shape``: the box of the array their blocks cover together, and a sharding of that
    box over those devices giving each device its same block. IfrtError (UNIMPLEMENTED)
    when their blocks do not tile a box evenly."""
    regions = shard_regions(sharding, shape)
    devices = tuple(sharding.devices[p] for p in positions)
    mine = [regions[p] for p in positions]
    box = tuple((min(r[a][0] for r in mine), max(r[a][1] for r in mine)) for a in range(len(shape)))
    if all(r == box for r in mine):
        return box, replicated(devices)
    starts = [sorted({r[a][0] for r in mine}) for a in range(len(shape))]
    tiles: dict[tuple[int, ...], list[int]] = {}
    for pos, r in enumerate(mine):
        tiles.setdefault(tuple(s.index(r[a][0]) for a, s in enumerate(starts)), []).append(pos)
    dims = [len(s) for s in starts]
    copies = {len(v) for v in tiles.values()}
    if len(tiles) == math.prod(dims) and len(copies) == 1:
        r = copies.pop()
        op = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER,
                                     tile_assignment_dimensions=dims + ([r] if r > 1 else []),
                                     tile_assignment_devices=[p for c in np.ndindex(*dims) for p in tiles[c]],
                                     replicate_on_last_tile_dim=r > 1)
        part = Sharding(devices, op.SerializeToString())
        local = [tuple((a - o, b - o) for (a, b), (o, _) in zip(reg, box)) for reg in mine]
        if shard_regions(part, tuple(b - a for a, b in box)) == local:
            return box, part
    raise IfrtError(UNIMPLEMENTED, f"the blocks the sharding gives devices {list(devices)[:16]} (one island's) do "
                                   "not tile one box of the array evenly, so they cannot be held as one array "
                                   "there; lay the array out on one island's devices, or with a mesh whose "
                                   "islands each hold an even block")


def tile_devices(o: xla_data_pb2.OpSharding, n: int) -> list[int]:
    """The logical device of each tile, in row-major tile order: a permutation of 0..n-1."""
    dims = list(o.tile_assignment_dimensions)
    if math.prod(dims) != n:
        raise invalid(f"the OpSharding's {math.prod(dims)} tiles {dims} are not one per device of {n}")
    try:
        return tile_assignment(o, dims, n)
    except WireError as e:
        raise invalid(str(e)) from None


# ---- host buffers ---------------------------------------------------------------------------

def host_view(buffer: memoryview | bytes, dtype: np.dtype, shape: tuple[int, ...],
              byte_strides: Optional[Sequence[int]]) -> np.ndarray:
    """The array a host buffer holds, without a copy; ``byte_strides`` as IFRT gives them."""
    itemsize = dtype.itemsize
    count = math.prod(shape)
    if byte_strides is None:
        if len(buffer) != count * itemsize:
            raise invalid(f"the host buffer has {len(buffer)} bytes; a {dtype.name}{list(shape)} array needs "
                          f"{count * itemsize}")
        return np.frombuffer(buffer, dtype).reshape(shape)
    strides = tuple(int(s) for s in byte_strides)
    if len(strides) != len(shape) or any(s < 0 for s in strides):
        raise invalid(f"byte_strides {list(strides)[:8]} do not fit shape {list(shape)}")
    span = 0 if count == 0 else sum((d - 1) * s for d, s in zip(shape, strides)) + itemsize
    if len(buffer) < span:
        raise invalid(f"the host buffer has {len(buffer)} bytes; byte_strides {list(strides)} over shape "
                      f"{list(shape)} reach {span}")
    return np.ndarray(shape, dtype, buffer=buffer, offset=0, strides=strides)


def c_contiguous(dtype: np.dtype, shape: tuple[int, ...], byte_strides: Optional[Sequence[int]]) -> bool:
    """Whether a host buffer of ``byte_strides`` (None: C order) holds its array in C order."""
    if byte_strides is None:
        return True
    expected, step = [], dtype.itemsize
    for d in reversed(shape):
        expected.append(step)
        step *= d
    return [int(s) for s in byte_strides] == expected[::-1]


def strided_bytes(array: np.ndarray, byte_strides: Optional[Sequence[int]]) -> np.ndarray:
    """``array`` laid out in a buffer with ``byte_strides`` (C order when None): a flat
    uint8 array, the buffer the client reads."""
    if byte_strides is None:
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    strides = tuple(int(s) for s in byte_strides)
    shape = array.shape
    if len(strides) != len(shape) or any(s < 0 for s in strides):
        raise invalid(f"byte_strides {list(strides)[:8]} do not fit shape {list(shape)}")
    count = math.prod(shape)
    span = 0 if count == 0 else sum((d - 1) * s for d, s in zip(shape, strides)) + array.dtype.itemsize
    out = np.zeros(span, np.uint8)
    if count:
        np.ndarray(shape, array.dtype, buffer=out, strides=strides)[...] = array
    return out


def byte_strides_of(message: object, field: str) -> Optional[list[int]]:
    return list(getattr(message, field).strides) if message.HasField(field) else None  # type: ignore[attr-defined]


def request_kind(request: ifrt_service_pb2.IfrtRequest) -> str:
    return request.WhichOneof("request") or "no request"
