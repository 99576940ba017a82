"""The devices an IFRT session sees, and where each one is in pathways terms.

Single-controller numbering: every device of the session's slices, island by island,
host (island rank) by host, device index by index; IFRT id = position. A set of IFRT
devices maps to one island's (host rank, device index) pairs and the workers hosting
them; devices of two islands share no interconnect: one computation cannot span them (an
array laid out across islands is held as one array per island). Pure: built from the slice
replies, no network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pathways.ifrt.types import IfrtError, INVALID_ARGUMENT, Sharding
from pathways.ir import Layout


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
    address: str
    slice: int


@dataclass(frozen=True)
class SliceDevices:
    """Where a set of IFRT devices lives: one slice of one island, the devices as pairs
    in the order given, and the hosts holding them (by island rank)."""

    slice: SliceInfo
    pairs: tuple[tuple[int, int], ...]
    workers: tuple[int, ...]
    addresses: tuple[str, ...]

    @property
    def workers_by_rank(self) -> dict[int, int]:
        ranks = sorted({r for r, _ in self.pairs})
        return dict(zip(ranks, self.workers))


class DeviceTable:
    def __init__(self, slices: Sequence[SliceInfo]) -> None:
        self.slices = {s.id: s for s in slices}
        devices: list[Device] = []
        for s in sorted(slices, key=lambda s: s.island):
            ranks = sorted({r for r, _ in s.devices})
            if len(ranks) != len(s.workers):
                raise ValueError(f"slice {s.id} names {len(ranks)} hosts but {len(s.workers)} workers")
            by_rank = {r: (w, a) for r, w, a in zip(ranks, s.workers, s.addresses)}
            for rank, index in sorted(s.devices):
                worker, address = by_rank[rank]
                devices.append(Device(len(devices), s.kind, s.island, rank, index, worker, address, s.id))
        self.devices = tuple(devices)

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
        hosts = sorted({(d.rank, d.worker, d.address) for d in devices})
        return SliceDevices(s, tuple((d.rank, d.index) for d in devices), tuple(w for _, w, _ in hosts),
                            tuple(a for _, _, a in hosts))

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
