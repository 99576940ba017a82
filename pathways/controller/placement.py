"""The resource manager: maps virtual slices onto physical devices. Pure: no I/O.

A slice lives on the devices of one worker host. Slices may share devices; the manager
puts each new slice on the least-loaded devices that fit, and ``exclusive`` slices get
devices nobody else uses (and keep them to themselves).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from pathways.errors import PlacementError


@dataclass
class Host:
    worker: int
    island: int
    kind: str
    ndevices: int
    memory_bytes: int
    load: list[int] = field(default_factory=list)  # slices placed on each device
    exclusive: set[int] = field(default_factory=set)  # devices held by an exclusive slice

    def __post_init__(self) -> None:
        self.load = [0] * self.ndevices


@dataclass(frozen=True)
class SlicePlacement:
    slice_id: int
    worker: int
    island: int
    kind: str
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    exclusive: bool
    owner: int


class ResourceManager:
    def __init__(self) -> None:
        self.hosts: dict[int, Host] = {}
        self.slices: dict[int, SlicePlacement] = {}
        self._ids = itertools.count(1)

    def add_host(self, worker: int, island: int, kind: str, ndevices: int, memory_bytes: int) -> None:
        self.hosts[worker] = Host(worker, island, kind, ndevices, memory_bytes)

    def place(self, count: int, kind: str, mesh_shape: Optional[tuple[int, ...]] = None,
              island: Optional[int] = None, exclusive: bool = False, owner: int = 0) -> SlicePlacement:
        """Choose devices for a slice of ``count`` devices of ``kind``, or explain why not."""
        if count < 1:
            raise PlacementError(f"a slice needs at least one device, got {count}")
        mesh_shape = tuple(mesh_shape) if mesh_shape else (count,)
        if _prod(mesh_shape) != count:
            raise PlacementError(f"mesh_shape {mesh_shape} has {_prod(mesh_shape)} devices, "
                                 f"but the slice asks for {count}; make their product equal")
        candidates = [h for h in self.hosts.values()
                      if h.kind == kind and (island is None or h.island == island)]
        best: Optional[tuple[tuple, Host, list[int]]] = None
        for host in candidates:
            free = [d for d in range(host.ndevices) if d not in host.exclusive
                    and (not exclusive or host.load[d] == 0)]
            if len(free) < count:
                continue
            chosen = sorted(free, key=lambda d: (host.load[d], d))[:count]
            score = (max(host.load[d] for d in chosen), sum(host.load), host.worker)
            if best is None or score < best[0]:
                best = (score, host, sorted(chosen))
        if best is None:
            raise PlacementError(self._explain(count, kind, island, exclusive))
        _, host, devices = best
        for d in devices:
            host.load[d] += 1
            if exclusive:
                host.exclusive.add(d)
        placement = SlicePlacement(next(self._ids), host.worker, host.island, kind,
                                   tuple(devices), mesh_shape, exclusive, owner)
        self.slices[placement.slice_id] = placement
        return placement

    def release(self, slice_id: int) -> None:
        placement = self.slices.pop(slice_id, None)
        host = self.hosts.get(placement.worker) if placement else None
        if host is None:
            return
        for d in placement.devices:
            host.load[d] -= 1
            if placement.exclusive:
                host.exclusive.discard(d)

    def release_owner(self, owner: int) -> None:
        for slice_id in [s.slice_id for s in self.slices.values() if s.owner == owner]:
            self.release(slice_id)

    def _explain(self, count: int, kind: str, island: Optional[int], exclusive: bool) -> str:
        if not self.hosts:
            return "the cluster has no worker hosts yet; start workers or wait for them to register"
        what = ", ".join(
            f"host {h.worker} (island {h.island}): {h.ndevices} {h.kind}"
            + (f", {len(h.exclusive)} held exclusively" if h.exclusive else "")
            for h in self.hosts.values())
        want = f"{count} {kind} device(s)" + (f" in island {island}" if island is not None else "")
        want += " not used by any other slice" if exclusive else ""
        return (f"cannot place a slice of {want} on one host; the cluster has: {what}. "
                "Ask for fewer devices, or start a cluster with more devices per host "
                "(pw.local_cluster(devices_per_host=N))")


def _prod(xs: tuple[int, ...]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n
