"""The devices an IFRT session sees, and where each one is in pathways terms.

Single-controller numbering: every device of the session's slices, island by island,
host (island rank) by host, device index by index; IFRT id = position. A set of IFRT
devices maps to one island's (host rank, device index) pairs and the workers hosting
them; devices of two islands share no interconnect: one computation cannot span them (an
array laid out across islands is held as one array per island). Pure: built from the slice
replies, no network. Where each host is (its address) is looked up when it is used, in the
table's ``HostAddresses``: an island that heals comes back with new processes under the same
worker ids, at new addresses (SliceMoved), and every array and executable follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from pathways.ifrt.types import IfrtError, INVALID_ARGUMENT, Sharding
from pathways.ir import Layout

log = logging.getLogger("pathways.ifrt")


@dataclass(frozen=True)
class SliceInfo:
    """One slice the session holds: as the controller's SliceReply describes it."""

    id: int
    kind: str
    island: int
    workers: tuple[int, ...]  # ordered by island rank
    addresses: tuple[str, ...]
    devices: tuple[tuple[int, int], ...]  # (host rank, device index)


@dataclass(frozen=True)
class Device:
    id: int
    kind: str
    island: int
    rank: int
    index: int
    worker: int
    slice: int


class HostAddresses:
    """The address of each worker of a session's slices, as the controller last said:
    placed (SliceInfo), then moved (``move``, called with messages.SliceMoved's fields by
    the native session's reader, which finds it among its slices by the slice's id)."""

    def __init__(self, slices: Sequence[SliceInfo]) -> None:
        self._by_worker = {w: a for s in slices for w, a in zip(s.workers, s.addresses)}
        self._workers = {s.id: s.workers for s in slices}

    def of(self, workers: Sequence[int]) -> tuple[str, ...]:
        return tuple(self._by_worker[w] for w in workers)

    def mover(self, slice_id: int) -> "_SliceMover":
        return _SliceMover(self, slice_id)

    def move(self, slice_id: int, workers: tuple[int, ...], addresses: tuple[str, ...]) -> None:
        if workers != self._workers[slice_id]:
            # a session resumed on other hosts: the devices the client sees would be others
            log.error("slice %d moved from workers %s to %s; an IFRT session follows new addresses of the "
                      "same hosts only, so its arrays and executables there fail from now on",
                      slice_id, self._workers[slice_id], workers)
            return
        self._by_worker.update(zip(workers, addresses))  # one assignment per key: safe beside readers


@dataclass
class _SliceMover:
    """What the native session keeps in ``Session.slices`` for one slice: ``move`` passes
    a SliceMoved on (its island and physical devices are those the table already has)."""

    book: HostAddresses
    slice_id: int

    def move(self, workers: tuple[int, ...], addresses: tuple[str, ...], island: int,
             physical: tuple[tuple[int, int], ...]) -> None:
        self.book.move(self.slice_id, workers, addresses)


@dataclass(frozen=True)
class SliceDevices:
    """Where a set of IFRT devices lives: one slice of one island, the devices as pairs
    in the order given, and the hosts holding them (by island rank), whose addresses are
    looked up in ``book`` at each use."""

    slice: SliceInfo
    pairs: tuple[tuple[int, int], ...]
    workers: tuple[int, ...]
    book: HostAddresses = field(compare=False, repr=False)

    @property
    def addresses(self) -> tuple[str, ...]:
        return self.book.of(self.workers)

    @property
    def workers_by_rank(self) -> dict[int, int]:
        ranks = sorted({r for r, _ in self.pairs})
        return dict(zip(ranks, self.workers))


class DeviceTable:
    def __init__(self, slices: Sequence[SliceInfo]) -> None:
        self.slices = {s.id: s for s in slices}
        self.book = HostAddresses(slices)
        self.movers = {s.id: self.book.mover(s.id) for s in slices}  # kept here: the session holds them weakly
        devices: list[Device] = []
        for s in sorted(slices, key=lambda s: s.island):
            ranks = sorted({r for r, _ in s.devices})
            if len(ranks) != len(s.workers):
                raise ValueError(f"slice {s.id} names {len(ranks)} hosts but {len(s.workers)} workers")
            by_rank = dict(zip(ranks, s.workers))
            for rank, index in sorted(s.devices):
                devices.append(Device(len(devices), s.kind, s.island, rank, index, by_rank[rank], s.id))
        self.devices = tuple(devices)

    def at(self, place: SliceInfo, pairs: tuple[tuple[int, int], ...], workers: tuple[int, ...]) -> SliceDevices:
        """``pairs`` of slice ``place`` on ``workers`` (by island rank)."""
        return SliceDevices(place, pairs, workers, self.book)

    def __len__(self) -> int:
        return len(self.devices)

    def get(self, device_id: int) -> Device:
        if not 0 <= device_id < len(self.devices):
            raise IfrtError(INVALID_ARGUMENT, f"device id {device_id} is not one of this session's "
                                              f"{len(self.devices)} devices (jax.devices())")
        return self.devices[device_id]

    def place(self, ids: Sequence[int], what: str = "the devices") -> SliceDevices:
        """Where ``ids`` live; IfrtError when they span islands or are unknown."""
        devices = [self.get(i) for i in ids]
        if not devices:
            raise IfrtError(INVALID_ARGUMENT, f"{what} name no device")
        islands = sorted({d.island for d in devices})
        if len(islands) > 1:
            raise IfrtError(INVALID_ARGUMENT, (
                f"{what} {list(ids)[:16]} span islands {islands}, which share no interconnect: one "
                "computation runs within one island. Use devices of one island (device attribute 'island'), "
                "and move arrays between islands with jax.device_put"))
        s = self.slices[devices[0].slice]
        hosts = sorted({(d.rank, d.worker) for d in devices})
        return self.at(s, tuple((d.rank, d.index) for d in devices), tuple(w for _, w in hosts))

    def islands(self, ids: Sequence[int]) -> list[list[int]]:
        """The positions in ``ids`` of each island's devices, island by island: one list
        for devices of one island, more for an array laid out across islands."""
        by_island: dict[int, list[int]] = {}
        for position, i in enumerate(ids):
            by_island.setdefault(self.get(i).island, []).append(position)
        return [by_island[k] for k in sorted(by_island)]

    def layout(self, sharding: Sharding, ndim: int) -> tuple[SliceDevices, Layout]:
        """The pathways Layout of an array with this IFRT sharding."""
        place = self.place(sharding.devices, "the array's devices")
        if sharding.replicated:
            return place, Layout(place.workers, place.pairs, (len(place.pairs),), ("d",), ())
        from pathways import hlo  # JAX-side: imported only for sharded arrays
        try:
            layout = hlo.layout_of_op_sharding(sharding.op, place.pairs, place.workers_by_rank, ndim)
        except Exception as e:
            raise IfrtError(INVALID_ARGUMENT, f"the array's sharding has no pathways layout: {e}") from None
        return place, layout
