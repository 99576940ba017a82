"""The resource manager: maps virtual slices onto physical devices. Pure: no I/O.

A slice lives on the devices of one host when it fits on one, and otherwise on several
hosts of one island (the same number of devices on each, hosts in rank order, so the
mesh's leading axis spans hosts). Slices may share devices; the manager puts each new
slice on the least-loaded devices that fit, and ``exclusive`` slices get devices nobody
else uses. Only healthy islands get new slices: not those still assembling (not all their
hosts have joined), lost (a host was lost) or healing, nor those an operator is retiring;
the islands registry (islands.py) says which take slices. Slices on an island that lost a
host are kept: they are valid again once the island heals, since its hosts keep their
worker ids.

Measured figures break the ties these rules leave: among hosts that are otherwise equal,
the faster devices (measured FLOP/s per device; hosts within SPEED_TOLERANCE of each
other count as equally fast, so that measurement noise does not decide), and for a slice
over several hosts, the set of hosts whose links to each other have the lowest measured
latency.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from pathways.controller.islands import Islands
from pathways.protocol.messages import Health
from pathways.errors import PlacementError

SPEED_TOLERANCE = 1.25  # per-device FLOP/s within this factor of a faster host's count as equal
UNMEASURED_LATENCY = 1.0  # seconds: a link not measured counts as slower than any measured one


@dataclass
class Host:
    worker: int
    island: int
    rank: int  # the host's index within its island
    kind: str
    ndevices: int
    memory_bytes: int
    flops: float = 0.0  # measured FLOP/s of the whole host; 0 until measured
    load: list[int] = field(default_factory=list)  # slices placed on each device
    exclusive: set[int] = field(default_factory=set)  # devices held by an exclusive slice

    def __post_init__(self) -> None:
        self.load = [0] * self.ndevices

    @property
    def device_flops(self) -> float:
        return self.flops / self.ndevices


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
    def __init__(self, islands: Islands) -> None:
        self.islands = islands  # whose health says which islands take slices
        self.hosts: dict[int, Host] = {}
        self.slices: dict[int, SlicePlacement] = {}
        self.latency: dict[tuple[int, int], float] = {}  # measured (from worker, to worker) -> seconds
        self._ids = itertools.count(1)

    def add_host(self, worker: int, island: int, kind: str, ndevices: int, memory_bytes: int,
                 rank: int = 0) -> None:
        host = self.hosts[worker] = Host(worker, island, rank, kind, ndevices, memory_bytes)
        for placement in self.slices.values():  # slices placed there before the island was lost
            if worker in placement.workers:
                for r, d in placement.devices:
                    if r == rank and d < ndevices:
                        host.load[d] += 1
                        if placement.exclusive:
                            host.exclusive.add(d)

    def set_flops(self, worker: int, flops: float) -> None:
        """Record a host's measured FLOP/s (all its devices together)."""
        if worker in self.hosts:
            self.hosts[worker].flops = flops

    def set_latency(self, src: int, dst: int, latency: Optional[float]) -> None:
        """Record the measured latency from ``src`` to ``dst`` in seconds (None: unmeasured)."""
        if latency is None or src not in self.hosts or dst not in self.hosts:
            self.latency.pop((src, dst), None)
        else:
            self.latency[(src, dst)] = latency

    def lose_island(self, island: int) -> set[int]:
        """A host of ``island`` was lost: forget all its hosts, whose worker ids are
        returned."""
        lost = {w for w, h in self.hosts.items() if h.island == island}
        for w in lost:
            del self.hosts[w]
        self.latency = {pair: t for pair, t in self.latency.items() if not lost & set(pair)}
        return lost

    def forget_island(self, island: int) -> list[SlicePlacement]:
        """The island was retired (or, lost, forgotten): drop its hosts and their latencies
        (as ``lose_island``), and release the slices placed there, which are returned."""
        gone = [p for p in self.slices.values() if p.island == island]
        for p in gone:
            del self.slices[p.slice_id]
        self.lose_island(island)
        return gone

    def place(self, count: int, kind: str, mesh_shape: Optional[tuple[int, ...]] = None,
              island: Optional[int] = None, exclusive: bool = False, owner: int = 0,
              slice_id: Optional[int] = None) -> SlicePlacement:
        """Choose devices for a slice of ``count`` devices of ``kind``, or explain why not.
        ``slice_id``: place an existing slice again (a resumed session's) under its id."""
        if count < 1:
            raise PlacementError(f"a slice needs at least one device, got {count}")
        mesh_shape = tuple(mesh_shape) if mesh_shape else (count,)
        if math.prod(mesh_shape) != count:
            raise PlacementError(f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} devices, "
                                 f"but the slice asks for {count}; make their product equal")
        candidates = [h for h in self.hosts.values() if h.kind == kind and self.islands.takes_slices(h.island)
                      and (island is None or h.island == island)]
        slowness = _slowness(candidates)
        best = self._best_on_one_host(candidates, count, exclusive, slowness)
        if best is None:
            best = self._best_across_hosts(candidates, count, exclusive, slowness)
        if best is None:
            raise PlacementError(self._explain(count, kind, island, exclusive))
        _, chosen = best
        for host, devices in chosen:
            for d in devices:
                host.load[d] += 1
                if exclusive:
                    host.exclusive.add(d)
        placement = SlicePlacement(next(self._ids) if slice_id is None else slice_id,
                                   tuple(h.worker for h, _ in chosen), chosen[0][0].island,
                                   kind, tuple((h.rank, d) for h, ds in chosen for d in ds),
                                   mesh_shape, exclusive, owner)
        self.slices[placement.slice_id] = placement
        return placement

    def place_with(self, like: SlicePlacement, slice_id: int) -> SlicePlacement:
        """Place slice ``slice_id`` on the devices of ``like`` (which shares them): a resumed
        session's slices that shared devices before it suspended share them again."""
        placement = dataclasses.replace(like, slice_id=slice_id)
        for worker in placement.workers:
            host = self.hosts[worker]
            for rank, d in placement.devices:
                if rank == host.rank:
                    host.load[d] += 1
        self.slices[slice_id] = placement
        return placement

    @staticmethod
    def _usable(host: Host, exclusive: bool) -> int:
        """How many of ``host``'s devices a new slice may use."""
        return sum(1 for d in range(host.ndevices) if d not in host.exclusive and (not exclusive or host.load[d] == 0))

    def _least_loaded(self, host: Host, n: int, exclusive: bool) -> Optional[list[int]]:
        """The ``n`` least-loaded usable devices of ``host`` in index order, if it has them."""
        free = [d for d in range(host.ndevices) if d not in host.exclusive
                and (not exclusive or host.load[d] == 0)]
        if len(free) < n:
            return None
        return sorted(sorted(free, key=lambda d: (host.load[d], d))[:n])

    def _best_on_one_host(self, candidates: list[Host], count: int, exclusive: bool,
                          slowness: dict[int, int]) -> Optional[tuple]:
        best: Optional[tuple] = None
        for host in candidates:
            chosen = self._least_loaded(host, count, exclusive)
            if chosen is None:
                continue
            score = (max(host.load[d] for d in chosen), sum(host.load), slowness[host.worker], host.worker)
            if best is None or score < best[0]:
                best = (score, [(host, chosen)])
        return best

    def _best_across_hosts(self, candidates: list[Host], count: int, exclusive: bool,
                           slowness: dict[int, int]) -> Optional[tuple]:
        """The least-loaded choice of k hosts of one island with count/k devices each, for
        the smallest k that works; then the fastest devices, then the fastest links."""
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
                        options.append(((max(host.load[d] for d in chosen), sum(host.load),
                                         slowness[host.worker]), host, chosen))
                if len(options) < k:
                    continue
                picked = self._pick_hosts(options, k)
                score = (max(o[0][0] for o in picked), sum(o[0][1] for o in picked),
                         max(o[0][2] for o in picked), self._link_cost([o[1] for o in picked]), isl)
                if best is None or score < best[0]:
                    best = (score, [(h, ds) for _, h, ds in sorted(picked, key=lambda o: o[1].rank)])
            if best is not None:
                return best
        return None

    def _pick_hosts(self, options: list[tuple], k: int) -> list[tuple]:
        """``k`` of ``options`` ((load and speed key, host, devices)): every host with a
        better key than the k-th best, and among the hosts tied with it, those that make the
        links of the whole set fastest (grown greedily from each possible start)."""
        options = sorted(options, key=lambda o: (o[0], o[1].rank))
        cut = options[k - 1][0]
        must = [o for o in options if o[0] < cut]
        ties = [o for o in options if o[0] == cut]
        if len(must) + len(ties) == k:
            return must + ties
        best: Optional[tuple] = None
        for seed in ([must] if must else [[t] for t in ties]):
            group = list(seed)
            rest = [t for t in ties if all(t is not g for g in group)]
            while len(group) < k:
                nxt = min(rest, key=lambda t: (self._link_cost([o[1] for o in group] + [t[1]]), t[1].rank))
                group.append(nxt)
                rest = [t for t in rest if t is not nxt]
            key = (self._link_cost([o[1] for o in group]), sorted(o[1].rank for o in group))
            if best is None or key < best[0]:
                best = (key, group)
        return best[1]

    def _link_cost(self, hosts: list[Host]) -> float:
        """The summed latency of the links between ``hosts``, both ways."""
        return sum(self.latency.get((a.worker, b.worker), UNMEASURED_LATENCY)
                   for a in hosts for b in hosts if a is not b)

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

    def island_name(self, island: int) -> str:
        """How messages name an island: by its name, with its id (``add_slice(island=)``) when they differ."""
        record = self.islands.by_id.get(island)
        name = record.name if record is not None else str(island)
        return f"island {island}" if name == str(island) else f"island {name!r} (id {island})"

    def _largest(self, kind: str, exclusive: bool) -> list[str]:
        """The largest slice of ``kind`` each island could take now: on one host, and evenly
        over k hosts (k times the k-th most free devices of a host)."""
        out = []
        for island in sorted({h.island for h in self.hosts.values() if self.islands.takes_slices(h.island)}):
            hosts = [h for h in self.hosts.values() if h.island == island and h.kind == kind]
            free = sorted((self._usable(h, exclusive) for h in hosts), reverse=True)
            if not free or not free[0]:
                continue
            k, per = max(((k, free[k - 1]) for k in range(1, len(free) + 1)), key=lambda kp: (kp[0] * kp[1], -kp[0]))
            over = f", or {k * per} over {k} hosts ({per} each)" if k > 1 else ""
            out.append(f"{self.island_name(island)}: up to {free[0]} on one host{over}")
        return out

    def _explain(self, count: int, kind: str, island: Optional[int], exclusive: bool) -> str:
        if not self.hosts:
            return "the cluster has no worker hosts yet; start workers or wait for them to register"
        if island is not None and island not in self.islands.by_id:
            return (f"there is no island {island}; the cluster's islands are "
                    f"{', '.join(map(self.island_name, sorted(self.islands.by_id)))}: ask for one of those ids "
                    "with add_slice(island=ID), or leave island= out for any island")
        unhealthy = self.islands.unhealthy()
        lost = unhealthy.get(Health.LOST, [])
        assembling = sorted(unhealthy.get(Health.ASSEMBLING, []) + unhealthy.get(Health.HEALING, []))
        what = ", ".join(
            f"host {h.worker} ({self.island_name(h.island)}"
            f"{self._mark(h.island)}): "
            f"{h.ndevices} {h.kind}" + (f", {len(h.exclusive)} held exclusively" if h.exclusive else "")
            for h in self.hosts.values())
        if lost:
            what += "; " + ", ".join(map(self.island_name, lost)) + " lost a host and are unhealthy"
        if assembling:
            what += ("; " + ", ".join(map(self.island_name, assembling)) + " are still assembling: "
                     "they take slices once all their hosts have joined (`python -m pathways status` shows how "
                     "many have)")
        if all(h.kind != kind for h in self.hosts.values()):
            return (f"no worker has {kind} devices; the cluster has: {what}. Ask for the kind it has "
                    "(cpu_devices=, gpu_devices=, tpu_devices=), or start workers on hosts with "
                    f"{kind} devices: `python -m pathways worker --platform "
                    f"{'cuda (or rocm)' if kind == 'gpu' else kind} ...`")
        want = f"{count} {kind} device(s)" + (f" in {self.island_name(island)}" if island is not None else "")
        want += " not used by any other slice" if exclusive else ""
        fits = self._largest(kind, exclusive)
        sizes = (f"The largest that fit now: {'; '.join(fits)}. Ask for one of those sizes" if fits
                 else "No island can take one now. Wait for an island to heal or assemble")
        return (f"cannot place a slice of {want} on one host or evenly over the healthy hosts of one "
                f"island; the cluster has: {what}. {sizes}, or add worker hosts with {kind} devices to an "
                "island (`python -m pathways worker --island NAME ...`); `python -m pathways status` lists "
                "the islands, their hosts and devices")

    def _mark(self, island: int) -> str:
        """Why a host's island takes no slices, for ``_explain``: its health, or its retirement."""
        isl = self.islands.by_id[island]
        return f", {isl.health.value}" if not isl.healthy else ", being retired" if isl.retiring else ""


def _slowness(hosts: list[Host]) -> dict[int, int]:
    """Each host's speed class, 0 for the fastest: hosts sorted by measured FLOP/s per
    device fall into one class as long as they are within SPEED_TOLERANCE of its fastest.
    Unmeasured hosts come last, in a class of their own."""
    measured = sorted((h for h in hosts if h.flops > 0), key=lambda h: -h.device_flops)
    classes: dict[int, int] = {}
    level, top = 0, None
    for h in measured:
        if top is None or h.device_flops * SPEED_TOLERANCE < top:
            level, top = (level + 1 if top is not None else 0), h.device_flops
        classes[h.worker] = level
    unmeasured = level + 1 if measured else 0
    return {h.worker: classes.get(h.worker, unmeasured) for h in hosts}
