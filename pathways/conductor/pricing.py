"""The candidate shardings of each operation of a graph, and what each costs on a mesh.

A *spec* gives each dimension of a tensor the mesh axis it is split over, or None; an axis
splits at most one dimension. An operation's candidates assign mesh axes to its loop
dimensions (``graph.Operation``), one axis per loop dimension at most, where the sizes
divide; every operand and result spec follows from the assignment.

Cost model (seconds; ``Figures`` holds the measured numbers):

- computation: the operation's FLOPs divided by the devices that share it (the product of
  the sizes of the axes it uses) and by the slowest device's FLOP/s;
- a reduced loop dimension split over axis ``a`` (k devices) leaves partial results that a
  ring all-reduce completes: ``2 (k-1) (latency_a + bytes / (k bandwidth_a))`` for a
  result shard of ``bytes``;
- ring attention over axis ``a`` (n devices) passes key and value blocks ``n - 1`` times:
  ``(n-1) (latency + kv block bytes / bandwidth)`` over the ring's slowest hop, besides its
  computation. A causal ring skips the blocks above the diagonal, but the device holding the
  last query block computes at every step, so the skipping saves no time;
- resharding a value between two specs (``reshard_seconds``), axis by axis: an axis that
  leaves a dimension is an all-gather, ``(k-1) (latency + shard bytes / bandwidth)``; one
  that moves to another dimension an all-to-all, ``(k-1) (latency + shard bytes /
  (k bandwidth))``; one that arrives costs nothing (each device keeps its part).

An axis's latency and bandwidth are those of the slowest link between devices adjacent along
it. Memory per device: arguments and results of the function are *resident* (held for the
whole call), every operation's operands, results and temporaries are its *working* bytes;
attention's temporaries are its score blocks (twice: exponentials and probabilities).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from pathways.conductor.graph import Graph, Operation

Spec = tuple[Optional[str], ...]

# Two devices of one host exchange data through the host's memory: these stand for that
# link, which the cluster does not measure.
SAME_HOST_LATENCY = 2e-6  # seconds
SAME_HOST_BANDWIDTH = 10e9  # bytes/s


@dataclass(frozen=True)
class Figures:
    """What a plan is priced with: the slowest device's speed and every pair's link."""

    flops: float  # FLOP/s of the slowest device
    latency: np.ndarray  # [i, j]: seconds from device i to device j
    bandwidth: np.ndarray  # [i, j]: bytes/s from device i to device j

    @property
    def count(self) -> int:
        return len(self.latency)


@dataclass(frozen=True)
class Mesh:
    """A mesh shape over the slice's devices (in their order) and its axes' links."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    latency: tuple[float, ...]  # per axis: the slowest link between neighbours along it
    bandwidth: tuple[float, ...]

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)]

    def positions(self, axis: str) -> list[list[int]]:
        """For each line of devices along ``axis``, the device indices along it."""
        grid = np.arange(int(np.prod(self.shape))).reshape(self.shape)
        moved = np.moveaxis(grid, self.axes.index(axis), -1)
        return [list(line) for line in moved.reshape(-1, self.size(axis))]


@dataclass(frozen=True)
class Candidate:
    """One way to run an operation: the mesh axis of each loop dimension it splits."""

    axes: tuple[Optional[str], ...]  # per loop dimension
    operand_specs: tuple[Spec, ...]
    result_specs: tuple[Spec, ...]
    seconds: float
    resident_bytes: float
    working_bytes: float
    reduce_over: tuple[str, ...] = ()  # axes whose partial results are all-reduced
    ring: Optional[str] = None  # attention run as ring attention over this axis
    label: str = ""


def meshes(count: int, figures: Figures) -> list[Mesh]:
    """The 1-D mesh and every 2-D factorisation of ``count`` devices."""
    shapes = [(count,)] + [(a, count // a) for a in range(2, count) if count % a == 0]
    names = {1: ("x",), 2: ("x", "y")}
    out = []
    for shape in shapes:
        axes = names[len(shape)]
        grid = np.arange(count).reshape(shape)
        lat, bw = [], []
        for i in range(len(shape)):
            src, dst = grid.ravel(), np.roll(grid, -1, axis=i).ravel()
            lat.append(float(figures.latency[src, dst].max()) if shape[i] > 1 else 0.0)
            bw.append(float(figures.bandwidth[src, dst].min()) if shape[i] > 1 else math.inf)
        out.append(Mesh(shape, axes, tuple(lat), tuple(bw)))
    return out


def specs(shape: Sequence[int], mesh: Mesh) -> list[Spec]:
    """Every spec of a tensor of ``shape`` on ``mesh``: each axis splits one dimension it divides, or none."""
    return list(_assignments(shape, mesh))


def _assignments(sizes: Sequence[int], mesh: Mesh) -> Iterator[Spec]:
    """Every way to give each of ``sizes``' dimensions a mesh axis or none, each axis at most
    one dimension whose size it divides."""
    for choice in itertools.product([None, *range(len(sizes))], repeat=len(mesh.axes)):
        dims = [d for d in choice if d is not None]
        if len(dims) != len(set(dims)):
            continue
        if any(d is not None and sizes[d] % mesh.shape[i] for i, d in enumerate(choice)):
            continue
        spec: list[Optional[str]] = [None] * len(sizes)
        for i, d in enumerate(choice):
            if d is not None:
                spec[d] = mesh.axes[i]
        yield tuple(spec)


def shard_bytes(nbytes: float, spec: Spec, mesh: Mesh) -> float:
    return nbytes / math.prod(mesh.size(a) for a in spec if a is not None)


@functools.lru_cache(maxsize=1 << 16)  # a graph asks for the same few moves many times
def reshard_seconds(nbytes: float, src: Spec, dst: Spec, mesh: Mesh) -> float:
    """Moving a value of ``nbytes`` laid out as ``src`` to ``dst`` (module docstring)."""
    if src == dst:
        return 0.0
    local = shard_bytes(nbytes, src, mesh)
    total = 0.0
    for i, axis in enumerate(mesh.axes):
        k = mesh.shape[i]
        was = src.index(axis) if axis in src else None
        now = dst.index(axis) if axis in dst else None
        if was is None or was == now:
            continue
        if now is None:
            total += (k - 1) * (mesh.latency[i] + local / mesh.bandwidth[i])
            local *= k
        else:
            total += (k - 1) * (mesh.latency[i] + local / (k * mesh.bandwidth[i]))
    return total


def all_reduce_seconds(nbytes: float, axis: str, mesh: Mesh) -> float:
    i = mesh.axes.index(axis)
    k = mesh.shape[i]
    return 2 * (k - 1) * (mesh.latency[i] + nbytes / (k * mesh.bandwidth[i]))


def candidates(graph: Graph, op: Operation, mesh: Mesh, figures: Figures,
               ring_latency: Callable[[str], tuple[float, float]]) -> list[Candidate]:
    """The candidates of ``op`` on ``mesh``, priced. ``ring_latency(axis)`` gives the
    (latency, bandwidth) of the slowest hop of the best ring along ``axis``."""
    if op.kind == "opaque":
        return [_priced(graph, op, mesh, figures, (), label="replicated")]
    out = []
    for axes in _assignments(op.loop, mesh):
        if not _allowed(graph, op, axes, mesh):
            continue
        out.append(_priced(graph, op, mesh, figures, axes))
        if op.kind == "attention":
            out.extend(_ring_candidates(graph, op, mesh, figures, axes, ring_latency))
    return out


def _allowed(graph: Graph, op: Operation, axes: Sequence[Optional[str]], mesh: Mesh) -> bool:
    """Whether every tensor dimension along a split loop dimension divides too, and the
    operation may be split there."""
    for d, axis in enumerate(axes):
        if axis is None:
            continue
        k = mesh.size(axis)
        if op.kind == "attention" and d > len(op.attention.batch):
            return False  # plain attention splits its batch and query dimensions; a ring splits the sequence
        for var, ds in [*zip(op.operands, op.operand_dims), *zip(op.results, op.result_dims)]:
            shape = var.aval.shape
            if any(t == d and shape[j] % k for j, t in enumerate(ds)):
                return False
    return True


def _spec(dims: Sequence[Optional[int]], axes: Sequence[Optional[str]]) -> Spec:
    return tuple(axes[t] if t is not None else None for t in dims)


def _priced(graph: Graph, op: Operation, mesh: Mesh, figures: Figures, axes: tuple[Optional[str], ...],
            label: str = "", ring: Optional[str] = None, ring_hop: tuple[float, float] = (0.0, math.inf)) -> Candidate:
    if not axes:
        axes = (None,) * len(op.loop)
    operand_specs = tuple(_spec(ds, axes) for ds in op.operand_dims)
    result_specs = tuple(_spec(ds, axes) for ds in op.result_dims)
    if ring is not None:
        a = op.attention
        nb = len(a.batch)
        operand_specs = tuple(_spec(ds, [ring if t in (nb, nb + 1) else x for t, x in enumerate(axes)])
                              for ds in op.operand_dims)
        result_specs = tuple(_spec(ds, [ring if t == nb else x for t, x in enumerate(axes)]) for ds in op.result_dims)
    sharing = math.prod(mesh.size(x) for x in {*axes, ring} if x is not None)
    in_bytes = [shard_bytes(graph.value_bytes(v), s, mesh) for v, s in zip(op.operands, operand_specs)]
    out_bytes = [shard_bytes(graph.value_bytes(v), s, mesh) for v, s in zip(op.results, result_specs)]
    temporaries = 0.0
    seconds = 0.0
    if op.kind == "attention":
        a = op.attention
        nb = len(a.batch)
        batch = math.prod(n // (mesh.size(axes[d]) if axes[d] else 1) for d, n in enumerate(a.batch))
        itemsize = 4
        if ring is None:
            q_rows = a.q_len // (mesh.size(axes[nb]) if axes[nb] else 1)
            temporaries = 2.0 * batch * q_rows * a.kv_len * itemsize
        else:
            n = mesh.size(ring)
            block = a.q_len // n
            temporaries = 2.0 * batch * block * (a.kv_len // n) * itemsize + 2.0 * (in_bytes[1] + in_bytes[2])
            seconds += (n - 1) * (ring_hop[0] + (in_bytes[1] + in_bytes[2]) / ring_hop[1])
    seconds += op.flops / sharing / figures.flops
    reduce_over = tuple(axes[d] for d in sorted(op.reduced) if axes[d] is not None) if ring is None else ()
    for axis in reduce_over:
        seconds += all_reduce_seconds(sum(out_bytes), axis, mesh)
    resident = 0.0
    if op.kind == "input":
        resident = sum(out_bytes)
    elif op.kind == "output":
        resident = sum(in_bytes)
    working = sum(in_bytes) + sum(out_bytes) + temporaries
    if not label:
        label = " ".join(show(s) for s in result_specs) or "-"
        if op.kind == "output":
            label = show(operand_specs[0])
        if reduce_over:
            label += " (partial sums, all-reduce over " + ",".join(reduce_over) + ")"
        if ring is not None:
            label += f" (ring attention over {ring})"
    return Candidate(axes, operand_specs, result_specs, seconds, resident, working, reduce_over, ring, label)


def _ring_candidates(graph: Graph, op: Operation, mesh: Mesh, figures: Figures, axes: tuple[Optional[str], ...],
                     ring_latency: Callable[[str], tuple[float, float]]) -> list[Candidate]:
    """Ring attention over each free axis, with ``axes`` splitting the leading batch dimension at most."""
    a = op.attention
    nb = len(a.batch)
    if nb not in (1, 2) or a.q_len != a.kv_len or any(x is not None for d, x in enumerate(axes) if d != 0):
        return []
    if nb == 1 and axes[0] is not None:
        return []  # the ring kernel splits the leading batch dimension only when there are heads
    out = []
    for ring in mesh.axes:
        n = mesh.size(ring)
        if ring in axes or n < 2 or a.q_len % n:
            continue
        out.append(_priced(graph, op, mesh, figures, axes, ring=ring, ring_hop=ring_latency(ring)))
    return out


def show(spec: Spec) -> str:
    """A spec as plans print it: ``[x,-,y]``."""
    return "[" + ",".join(a or "-" for a in spec) + "]"
