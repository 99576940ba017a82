"""The program IR shared by client, controller and workers.

A program is a graph of sharded computations over numbered values. The client builds it
by tracing; the controller lowers it (controller/lowering.py) to one op stream per worker.
Everything here is plain data with a wire form; nothing here talks to a network or to JAX.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Union

from pathways.errors import WireError
from pathways.wire.codec import Region
from pathways.wire.codec import int_list, is_wire_dtype_name

SpecEntry = Union[None, str, tuple[str, ...]]


Device = tuple[int, int]  # (rank of the host in its island, local device index)


@dataclass(frozen=True)
class Layout:
    """Where and how an array lives: devices of one or more hosts of an island, a mesh over
    them (in mesh order), and a partition spec.

    ``workers`` are the worker ids of the hosts involved, ordered by island rank; a device
    is named by its host's island rank and its index among that host's devices.

    ``unreduced`` names mesh axes (none of the spec's) along which devices hold partial
    values whose sum is the array (XLA's UNREDUCED): each device's block is the one the
    spec gives it, but its bytes are its own, not a replica of its neighbours'.
    """

    workers: tuple[int, ...]
    devices: tuple[Device, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: tuple[SpecEntry, ...]
    unreduced: tuple[str, ...] = ()

    @property
    def multi_host(self) -> bool:
        return len(self.workers) > 1

    def to_wire(self) -> list:
        raw = [list(self.workers), [x for d in self.devices for x in d], list(self.mesh_shape),
               list(self.axis_names), [list(e) if isinstance(e, tuple) else e for e in self.spec]]
        return raw + [list(self.unreduced)] if self.unreduced else raw

    @staticmethod
    def from_wire(raw: Any) -> "Layout":
        if not isinstance(raw, list) or len(raw) not in (5, 6):
            raise WireError("a layout must be a list [workers, devices, mesh_shape, axis_names, spec"
                            "[, unreduced axes]]")
        workers, devices, mesh_shape, axis_names, spec = raw[:5]
        unreduced = raw[5] if len(raw) == 6 else []
        workers = int_list(workers, "layout workers")
        if not workers or len(set(workers)) != len(workers):
            raise WireError("layout workers must be a non-empty list of distinct worker ids")
        if not isinstance(axis_names, list) or not all(isinstance(a, str) for a in axis_names):
            raise WireError("layout axis_names must be a list of strings")
        mesh_shape = int_list(mesh_shape, "layout mesh_shape")
        flat = int_list(devices, "layout devices")
        if len(flat) % 2 or any(x < 0 for x in flat):
            raise WireError("layout devices must be a flat list of (host rank, device index) pairs")
        pairs = tuple(zip(flat[::2], flat[1::2]))
        if len(set(pairs)) != len(pairs):
            raise WireError("layout devices must be distinct")
        if len(mesh_shape) != len(axis_names) or math.prod(mesh_shape) != len(pairs):
            raise WireError(f"layout mesh {mesh_shape} x {axis_names} does not fit {len(pairs)} devices")
        entries = spec_from_wire(spec, axis_names)
        named = {n for e in entries if e is not None for n in ((e,) if isinstance(e, str) else e)}
        if (not isinstance(unreduced, list) or not all(isinstance(a, str) for a in unreduced)
                or len(set(unreduced)) != len(unreduced)
                or any(a not in axis_names or a in named for a in unreduced)):
            raise WireError(f"layout unreduced axes {unreduced!r} must be distinct axes of mesh {axis_names} "
                            "that the partition spec does not name")
        return Layout(tuple(workers), pairs, tuple(mesh_shape), tuple(axis_names), entries, tuple(unreduced))


def device_regions(shape: tuple[int, ...], layout: Layout) -> list[Region]:
    """The block of ``shape`` each device of ``layout`` holds, in the layout's device order."""
    sizes = dict(zip(layout.axis_names, layout.mesh_shape))
    regions = []
    for position in itertools.product(*map(range, layout.mesh_shape)):  # devices are in mesh order
        coords = dict(zip(layout.axis_names, position))
        region = []
        for dim, size in enumerate(shape):
            entry = layout.spec[dim] if dim < len(layout.spec) else None
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            blocks, block = 1, 0
            for axis in axes:
                blocks *= sizes[axis]
                block = block * sizes[axis] + coords[axis]
            step = size // blocks
            region.append((block * step, (block + 1) * step))
        regions.append(tuple(region))
    return regions


def stacked(layout: Layout) -> Layout:
    """The layout of an unreduced array's partial values stacked along a new leading
    dimension split over its unreduced axes: each device's block of the stack is its own
    partial value of its block, so moving the stack, block by block as any array, keeps
    every partial value. Its size is ``partials(layout)``."""
    return Layout(layout.workers, layout.devices, layout.mesh_shape, layout.axis_names,
                  (layout.unreduced, *layout.spec))


def partials(layout: Layout) -> int:
    """How many partial values of each block an array of ``layout`` holds (1 unless unreduced)."""
    return math.prod(layout.mesh_shape[layout.axis_names.index(a)] for a in layout.unreduced)


def host_regions(shape: tuple[int, ...], layout: Layout) -> dict[int, list[Region]]:
    """The distinct blocks each worker of ``layout`` holds, in device order."""
    out: dict[int, list[Region]] = {w: [] for w in layout.workers}
    worker_of = dict(zip(sorted({rank for rank, _ in layout.devices}), layout.workers))
    for (rank, _), region in zip(layout.devices, device_regions(shape, layout)):
        held = out[worker_of[rank]]
        if region not in held:
            held.append(region)
    return out


def block_holders(shape: tuple[int, ...], layout: Layout) -> dict[int, tuple[Region, ...]]:
    """Each distinct block of an array of ``shape`` laid out by ``layout`` (evenly divided,
    not unreduced), given to the first worker in the layout's order that holds it: worker
    -> its blocks that no worker before it holds. A worker holding only blocks held before
    it is left out, so that a block replicated on several hosts is saved, or read, once."""
    taken: set[Region] = set()
    out = {}
    for worker, regions in host_regions(shape, layout).items():
        mine = tuple(r for r in regions if r not in taken)
        taken.update(mine)
        if mine:
            out[worker] = mine
    return out


def reading_positions(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """The positions in ``layout.workers`` of the workers a read of a whole array asks:
    those holding a block no earlier one holds (``block_holders``); every worker where
    the blocks are uneven, or hold partial values (unreduced)."""
    if layout.unreduced or not evenly_divided(shape, layout):
        return tuple(range(len(layout.workers)))
    holders = block_holders(shape, layout)
    return tuple(i for i, w in enumerate(layout.workers) if w in holders)


def evenly_divided(shape: tuple[int, ...], layout: Layout) -> bool:
    """Whether every dimension of ``shape`` splits into equal blocks over its mesh axes
    (the block arithmetic above assumes it)."""
    sizes = dict(zip(layout.axis_names, layout.mesh_shape))
    for dim, size in enumerate(shape):
        entry = layout.spec[dim] if dim < len(layout.spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if size % math.prod(sizes[a] for a in axes):
            return False
    return True


def spec_from_wire(raw: Any, axis_names: list | tuple) -> tuple[SpecEntry, ...]:
    if not isinstance(raw, list):
        raise WireError("a partition spec must be a list")
    out: list[SpecEntry] = []
    for entry in raw:
        names = [entry] if isinstance(entry, str) else entry
        if entry is None:
            out.append(None)
            continue
        if not isinstance(names, list) or not all(isinstance(n, str) and n in axis_names for n in names):
            raise WireError(f"partition spec entry {entry!r} names no axis of mesh {list(axis_names)}")
        out.append(entry if isinstance(entry, str) else tuple(entry))
    named = [n for e in out if e is not None for n in ((e,) if isinstance(e, str) else e)]
    if len(set(named)) != len(named):
        raise WireError(f"partition spec {raw} names a mesh axis more than once")
    return tuple(out)


@dataclass(frozen=True)
class Node:
    """One sharded computation: compiled function ``fn`` reading and writing value numbers."""

    fn: int
    ins: tuple[int, ...]
    outs: tuple[int, ...]


ValueType = tuple[str, tuple[int, ...]]  # (dtype name, shape)
DISPATCH_MODES = ("parallel", "sequential")  # how a program's nodes reach their workers
# The most nodes (compiled-function calls) one program may have: the controller lowers a
# program in one go, a few microseconds per node, and must stay well within the heartbeat
# timeout meanwhile (a million nodes held it past 10 s, and its workers gave it up).
MAX_PROGRAM_NODES = 1 << 16


def too_many_nodes(nodes: int) -> str:
    """Why a program of ``nodes`` nodes is refused, or "" if it is not."""
    if nodes <= MAX_PROGRAM_NODES:
        return ""
    return (f"a program of {nodes} nodes has more than the {MAX_PROGRAM_NODES} one may have: split it into "
            "several programs, or move a loop into a compiled function (jax.lax.fori_loop, jax.lax.scan)")


@dataclass(frozen=True)
class ProgramGraph:
    """Values are numbered 0..nvalues-1; inputs are bound per call, nodes are in trace order.

    Every value's dtype and shape is static and part of the graph: the lowering plans
    transfers from them before anything has run.
    """

    nvalues: int
    inputs: tuple[int, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]
    types: tuple[ValueType, ...]

    def shape(self, v: int) -> tuple[int, ...]:
        return self.types[v][1]

    def to_wire(self) -> dict:
        return {"nvalues": self.nvalues, "inputs": list(self.inputs),
                "nodes": [[n.fn, list(n.ins), list(n.outs)] for n in self.nodes],
                "outputs": list(self.outputs), "types": [[d, list(s)] for d, s in self.types]}

    @staticmethod
    def from_wire(raw: Any) -> "ProgramGraph":
        if not isinstance(raw, dict):
            raise WireError("a program graph must be a map")
        nvalues = raw.get("nvalues")
        if not isinstance(nvalues, int) or not 0 < nvalues < 1 << 20:
            raise WireError("program graph nvalues must be a positive integer below 2**20")
        inputs = int_list(raw.get("inputs"), "program graph inputs")
        outputs = int_list(raw.get("outputs"), "program graph outputs")
        raw_nodes = raw.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise WireError("program graph nodes must be a non-empty list")
        if too_many_nodes(len(raw_nodes)):
            raise WireError(too_many_nodes(len(raw_nodes)))
        nodes = []
        for rn in raw_nodes:
            if not isinstance(rn, list) or len(rn) != 3 or not isinstance(rn[0], int):
                raise WireError("a program graph node must be [fn, ins, outs]")
            nodes.append(Node(rn[0], tuple(int_list(rn[1], "node ins")), tuple(int_list(rn[2], "node outs"))))
        raw_types = raw.get("types")
        if not isinstance(raw_types, list) or len(raw_types) != nvalues:
            raise WireError(f"program graph types must list a [dtype, shape] for each of its {nvalues} values")
        types = []
        for t in raw_types:
            if not isinstance(t, list) or len(t) != 2 or not is_wire_dtype_name(t[0]):
                raise WireError(f"value type {t!r} is not a [dtype, shape] pair of an allowed dtype")
            shape = int_list(t[1], "value shape")
            if any(d < 0 for d in shape):
                raise WireError(f"value shape {shape} has a negative dimension")
            types.append((t[0], tuple(shape)))
        graph = ProgramGraph(nvalues, tuple(inputs), tuple(nodes), tuple(outputs), tuple(types))
        graph.check()
        return graph

    def check(self) -> None:
        """Every value is defined once before it is read, and every number is in range."""
        defined: set[int] = set()
        for v in self.inputs:
            self._define(v, defined)
        for node in self.nodes:
            for v in node.ins:
                if v not in defined:
                    raise WireError(f"node reads value {v} before any node defines it")
            for v in node.outs:
                self._define(v, defined)
        for v in self.outputs:
            if v not in defined:
                raise WireError(f"program output {v} is never defined")

    def _define(self, v: int, defined: set[int]) -> None:
        if not 0 <= v < self.nvalues:
            raise WireError(f"value number {v} is outside 0..{self.nvalues - 1}")
        if v in defined:
            raise WireError(f"value {v} is defined twice")
        defined.add(v)

