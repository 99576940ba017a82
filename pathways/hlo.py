"""XLA shardings as pathways layouts, and back.

An XLA executable says where each parameter and output lives with an ``OpSharding`` over
its logical devices 0..n-1; pathways says it with a ``Layout`` over (host rank, device
index) pairs of an island. ``devices`` maps one to the other: logical device i is
``devices[i]``.

A tiled OpSharding with tile dimensions (d0..dk-1), plus a last dimension of replicas
when ``replicate_on_last_tile_dim``, or one last dimension per subgroup (``last_tile_dims``:
REPLICATED, UNREDUCED), becomes a mesh of that shape with axes ("t0".."t{k-1}", then "r"
for replicas and "u" for unreduced partial values), dimension i of the array split over
axis "t{i}" (when di > 1), and the mesh's devices in tile order: the tile assignment,
explicit or iota (any reshape and transpose). REPLICATED covers every device on a one-axis
mesh ("r",), UNREDUCED on ("u",); MAXIMAL is its one device. Pure: protobuf only.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from pathways.errors import WireError
from pathways.proto.xla import xla_data_pb2
from pathways.ir import Device, Layout

OpSharding = xla_data_pb2.OpSharding
REPLICA_AXIS = "r"
UNREDUCED_AXIS = "u"
# the mesh axis of each subgroup kind a layout holds
_SUBGROUP_AXES = {OpSharding.REPLICATED: REPLICA_AXIS, OpSharding.UNREDUCED: UNREDUCED_AXIS}


def row_major(ndim: int) -> tuple[int, ...]:
    """The default layout of a rank-``ndim`` array, as minor_to_major dimensions."""
    return tuple(range(ndim - 1, -1, -1))


def replicated() -> bytes:
    """The serialized OpSharding of a value every device holds whole."""
    return OpSharding(type=OpSharding.REPLICATED).SerializeToString()


def layout_of_op_sharding(op: bytes, devices: Sequence[Device], workers_by_rank: Mapping[int, int],
                          ndim: int) -> Layout:
    """The layout of an array of rank ``ndim`` sharded by serialized OpSharding ``op``
    over logical devices ``devices``; ``workers_by_rank`` names the worker of each host
    rank. Raises WireError for what a layout cannot express (tuple, manual or unknown
    shardings, manual subgroups)."""
    sharding = OpSharding()
    try:
        sharding.ParseFromString(op)
    except Exception as e:  # protobuf's DecodeError, or anything a hostile blob provokes
        raise WireError(f"the sharding is no serialized xla OpSharding ({type(e).__name__}: {e})") from None
    n = len(devices)
    if not n:
        raise WireError("a sharding needs at least one device")
    kind = sharding.type
    if kind in (OpSharding.REPLICATED, OpSharding.UNREDUCED):
        axis = _SUBGROUP_AXES[kind]
        return _layout(devices, range(n), (n,), (axis,), (), workers_by_rank,
                       (axis,) if kind == OpSharding.UNREDUCED else ())
    if kind == OpSharding.MAXIMAL:
        ids = tile_assignment(sharding, (1,), n)
        return _layout(devices, ids, (1,), (REPLICA_AXIS,), (), workers_by_rank)
    if kind != OpSharding.OTHER:
        raise WireError(f"a {OpSharding.Type.Name(kind)} sharding has no pathways layout; only replicated, "
                        "unreduced, maximal and tiled shardings do")
    if sharding.HasField("named_sharding"):
        raise WireError("a named (mesh-axis) OpSharding has no pathways layout here; send its tiled form")
    dims = tuple(sharding.tile_assignment_dimensions)
    subgroups = list(sharding.last_tile_dims)
    if sharding.replicate_on_last_tile_dim:
        if subgroups:
            raise WireError("a sharding both replicated on its last tile dimension and with subgroups "
                            f"{_names(subgroups)} is malformed; XLA gives one or the other")
        subgroups = [OpSharding.REPLICATED]
    axes_of = [_SUBGROUP_AXES.get(t) for t in subgroups]
    if None in axes_of or len(set(axes_of)) != len(axes_of):
        raise WireError(f"a sharding with subgroups {_names(subgroups)} has no pathways layout; only one "
                        "subgroup each of replicas and unreduced partial values does")
    tiled = len(dims) - len(subgroups)
    if tiled != ndim:
        raise WireError(f"a tiled sharding of {len(dims)} tile dimensions {list(dims)} does not fit an array "
                        f"of rank {ndim}" + (f" plus subgroups {_names(subgroups)}" if subgroups else ""))
    if any(d < 1 for d in dims):
        raise WireError(f"tile dimensions {list(dims)} must be positive")
    ids = tile_assignment(sharding, dims, n)
    axes = tuple(f"t{i}" for i in range(tiled)) + tuple(axes_of)
    spec = tuple(f"t{i}" if dims[i] > 1 else None for i in range(tiled))
    return _layout(devices, ids, dims, axes, spec, workers_by_rank, (UNREDUCED_AXIS,) * (UNREDUCED_AXIS in axes_of))


def _names(subgroups: Sequence[int]) -> list[str]:
    return [OpSharding.Type.Name(t) if t in OpSharding.Type.values() else str(t) for t in subgroups]


def op_sharding_of_layout(layout: Layout, devices: Sequence[Device], ndim: int | None = None) -> bytes:
    """The serialized OpSharding of ``layout`` over logical devices ``devices`` (logical
    id = position in ``devices``), for an array of rank ``ndim`` (default: the length of
    the layout's partition spec). Raises WireError for a layout on other devices."""
    position = {d: i for i, d in enumerate(devices)}
    missing = [d for d in layout.devices if d not in position]
    if missing:
        raise WireError(f"the layout's devices {missing} are not among the executable's devices {list(devices)}")
    rank = len(layout.spec) if ndim is None else ndim
    if len(layout.spec) > rank:
        raise WireError(f"a partition spec of {len(layout.spec)} entries does not fit an array of rank {rank}")
    if len(layout.devices) == 1:
        if len(devices) == 1:
            return replicated()
        return OpSharding(type=OpSharding.MAXIMAL, tile_assignment_dimensions=[1],
                          tile_assignment_devices=[position[layout.devices[0]]]).SerializeToString()
    mesh = np.array([position[d] for d in layout.devices]).reshape(layout.mesh_shape)
    axis = {name: i for i, name in enumerate(layout.axis_names)}
    spec = list(layout.spec) + [None] * (rank - len(layout.spec))
    split = [(e,) if isinstance(e, str) else tuple(e or ()) for e in spec]
    used = [axis[name] for names in split for name in names]
    partial = [axis[name] for name in layout.unreduced]
    rest = [i for i in range(len(layout.mesh_shape)) if i not in used and i not in partial]
    dims = [math.prod(layout.mesh_shape[axis[name]] for name in names) for names in split]
    parts = math.prod(layout.mesh_shape[i] for i in partial)
    replicas = math.prod(layout.mesh_shape[i] for i in rest)
    if all(d == 1 for d in dims) and replicas == 1 and sorted(mesh.flat) == list(range(len(devices))):
        return OpSharding(type=OpSharding.UNREDUCED).SerializeToString() if partial else replicated()
    if all(d == 1 for d in dims) and parts == 1 and sorted(mesh.flat) == list(range(len(devices))):
        return replicated()
    subgroups = [(OpSharding.UNREDUCED, parts)] * bool(partial) + [(OpSharding.REPLICATED, replicas)] * (replicas > 1)
    tiles = mesh.transpose(used + partial + rest).reshape(dims + [size for _, size in subgroups])
    last = [kind for kind, _ in subgroups]
    return OpSharding(type=OpSharding.OTHER, tile_assignment_dimensions=list(tiles.shape),
                      tile_assignment_devices=[int(i) for i in tiles.flat],
                      replicate_on_last_tile_dim=last == [OpSharding.REPLICATED],
                      last_tile_dims=last if partial else []).SerializeToString()


def tile_assignment(sharding: OpSharding, dims: Sequence[int], n: int) -> list[int]:
    """The logical device of each tile, in row-major tile order (explicit or iota form,
    any reshape and transpose), for tile dimensions ``dims`` over ``n`` devices; WireError
    unless it names distinct devices among them."""
    count = math.prod(dims)
    if sharding.iota_reshape_dims:
        reshape = list(sharding.iota_reshape_dims)
        perm = list(sharding.iota_transpose_perm) or list(range(len(reshape)))
        if (any(d < 1 for d in reshape) or math.prod(reshape) != count
                or sorted(perm) != list(range(len(reshape)))):
            raise WireError(f"iota tile assignment {reshape} transposed {perm} does not fill {count} tiles")
        ids = [int(i) for i in np.arange(count).reshape(reshape).transpose(perm).flat]
    else:
        ids = list(sharding.tile_assignment_devices)
        if len(ids) != count:
            raise WireError(f"the tile assignment lists {len(ids)} devices for {count} tiles")
    if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
        raise WireError(f"the tile assignment {ids[:16]} must name distinct devices among the executable's {n}")
    return ids


def _layout(devices: Sequence[Device], ids: Sequence[int], mesh_shape: tuple[int, ...], axes: tuple[str, ...],
            spec: tuple, workers_by_rank: Mapping[int, int], unreduced: tuple[str, ...] = ()) -> Layout:
    pairs = tuple(tuple(devices[i]) for i in ids)
    try:
        workers = tuple(workers_by_rank[r] for r in sorted({r for r, _ in pairs}))
    except KeyError as e:
        raise WireError(f"host rank {e.args[0]} of the sharding's devices has no worker") from None
    return Layout(workers, pairs, tuple(mesh_shape), axes, spec, unreduced)
