"""The resource manager: maps virtual slices onto physical devices. Pure: no I/O.

A slice lives on the devices of one host when it fits on one, and otherwise on several
hosts of one island (the same number of devices on each, hosts in rank order, so the
mesh's leading axis spans hosts). Slices may share devices; the manager puts each new
slice on the least-loaded devices that fit, and ``exclusive`` slices get devices nobody
else uses. Islands marked unhealthy (a host was lost) get no new slices.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from pathways.errors import PlacementError


@dataclass
class Host:
    worker: int
    island: int
    rank: int  # the host's index within its island
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
    workers: tuple[int, ...]
    island: int
    kind: str
    devices: tuple[tuple[int, int], ...]  # (host rank, local device), in mesh order
    mesh_shape: tuple[int, ...]
    exclusive: bool
    owner: int


class ResourceManager:
    def __init__(self) -> None:
        self.hosts: dict[int, Host] = {}
        self.slices: dict[int, SlicePlacement] = {}
        self.unhealthy: set[int] = set()  # islands that lost a host
        self._ids = itertools.count(1)

    def add_host(self, worker: int, island: int, kind: str, ndevices: int, memory_bytes: int,
                 rank: int = 0) -> None:
        self.hosts[worker] = Host(worker, island, rank, kind, ndevices, memory_bytes)

    def lose_island(self, island: int) -> set[int]:
        """A host of ``island`` was lost: mark it unhealthy and forget all its hosts, whose
        worker ids are returned."""
        self.unhealthy.add(island)
        lost = {w for w, h in self.hosts.items() if h.island == island}
        for w in lost:
            del self.hosts[w]
        return lost

    def place(self, count: int, kind: str, mesh_shape: Optional[tuple[int, ...]] = None,
              island: Optional[int] = None, exclusive: bool = False, owner: int = 0) -> SlicePlacement:
        """Choose devices for a slice of ``count`` devices of ``kind``, or explain why not."""
        if count < 1:
            raise PlacementError(f"a slice needs at least one device, got {count}")
        mesh_shape = tuple(mesh_shape) if mesh_shape else (count,)
        if math.prod(mesh_shape) != count:
            raise PlacementError(f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} devices, "
                                 f"but the slice asks for {count}; make their product equal")
        candidates = [h for h in self.hosts.values() if h.kind == kind and h.island not in self.unhealthy
                      and (island is None or h.island == island)]
        best = self._best_on_one_host(candidates, count, exclusive)
        if best is None:
            best = self._best_across_hosts(candidates, count, exclusive)
        if best is None:
            raise PlacementError(self._explain(count, kind, island, exclusive))
        _, chosen = best
        for host, devices in chosen:
            for d in devices:
                host.load[d] += 1
                if exclusive:
                    host.exclusive.add(d)
        placement = SlicePlacement(next(self._ids), tuple(h.worker for h, _ in chosen), chosen[0][0].island,
                                   kind, tuple((h.rank, d) for h, ds in chosen for d in ds),
                                   mesh_shape, exclusive, owner)
        self.slices[placement.slice_id] = placement
        return placement

    def _least_loaded(self, host: Host, n: int, exclusive: bool) -> Optional[list[int]]:
        """The ``n`` least-loaded usable devices of ``host`` in index order, if it has them."""
        free = [d for d in range(host.ndevices) if d not in host.exclusive
                and (not exclusive or host.load[d] == 0)]
        if len(free) < n:
            return None
        return sorted(sorted(free, key=lambda d: (host.load[d], d))[:n])

    def _best_on_one_host(self, candidates: list[Host], count: int, exclusive: bool) -> Optional[tuple]:
        best: Optional[tuple] = None
        for host in candidates:
            chosen = self._least_loaded(host, count, exclusive)
            if chosen is None:
                continue
            score = (max(host.load[d] for d in chosen), sum(host.load), host.worker)
            if best is None or score < best[0]:
                best = (score, [(host, chosen)])
        return best

    def _best_across_hosts(self, candidates: list[Host], count: int, exclusive: bool) -> Optional[tuple]:
        """The least-loaded choice of k hosts of one island with count/k devices each, for
        the smallest k that works."""
        best: Optional[tuple] = None
        islands = sorted({h.island for h in candidates})
        for k in range(2, len(candidates) + 1):
            if count % k:
                continue
            per_host = count // k
            for isl in islands:
                options = []
                for host in (h for h in candidates if h.island == isl):
                    chosen = self._least_loaded(host, per_host, exclusive)
                    if chosen is not None:
                        options.append(((max(host.load[d] for d in chosen), sum(host.load), host.rank),
                                        host, chosen))
                if len(options) < k:
                    continue
                picked = sorted(options, key=lambda o: o[0])[:k]
                score = (max(o[0][0] for o in picked), sum(o[0][1] for o in picked), isl)
                if best is None or score < best[0]:
                    best = (score, [(h, ds) for _, h, ds in sorted(picked, key=lambda o: o[1].rank)])
            if best is not None:
                return best
        return None

    def release(self, slice_id: int) -> None:
        placement = self.slices.pop(slice_id, None)
        if placement is None:
            return
        for worker in placement.workers:
            host = self.hosts.get(worker)
            if host is None:
                continue
            for rank, d in placement.devices:
                if rank == host.rank:
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
            f"host {h.worker} (island {h.island}{', unhealthy' if h.island in self.unhealthy else ''}): "
            f"{h.ndevices} {h.kind}" + (f", {len(h.exclusive)} held exclusively" if h.exclusive else "")
            for h in self.hosts.values())
        if self.unhealthy:
            what += f"; island(s) {sorted(self.unhealthy)} lost a host and are unhealthy"
        want = f"{count} {kind} device(s)" + (f" in island {island}" if island is not None else "")
        want += " not used by any other slice" if exclusive else ""
        return (f"cannot place a slice of {want} on one host or evenly over the healthy hosts of one "
                f"island; the cluster has: {what}. Ask for fewer devices, or start a cluster with more "
                "(pw.local_cluster(islands=[pw.Island(hosts=H, devices_per_host=D)]))")
