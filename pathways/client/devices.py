"""Virtual devices: slices the user asks for, placed by the controller's resource manager.

The user sees slices, their virtual devices and meshes over them; which physical devices
back a slice is the controller's business (the client keeps it only to address buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from jax.sharding import PartitionSpec

from pathways.errors import PlacementError
from pathways.ir import Layout
from pathways.protocol import messages as m


class VirtualDeviceSet:
    """A set of slices requested together: ``pw.make_virtual_device_set().add_slice(...)``."""

    def __init__(self, session: "Session") -> None:  # noqa: F821
        self._session = session
        self.slices: list[Slice] = []

    def add_slice(self, cpu_devices: Optional[int] = None, mesh_shape: Optional[Sequence[int]] = None,
                  island: Optional[int] = None, exclusive: bool = False, *,
                  gpu_devices: Optional[int] = None, tpu_devices: Optional[int] = None) -> "Slice":
        """Ask the controller for a slice of ``n`` devices of one kind: cpu, gpu (workers started
        with ``--platform cuda`` or ``rocm``) or tpu (``--platform tpu``). ``island``: an island's
        integer id, as ``pathways status`` shows it (default: any island)."""
        asked = {k: n for k, n in (("cpu", cpu_devices), ("gpu", gpu_devices), ("tpu", tpu_devices)) if n is not None}
        if len(asked) != 1:
            raise PlacementError("add_slice takes exactly one of cpu_devices=, gpu_devices=, tpu_devices=")
        (kind, count), = asked.items()
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise PlacementError(f"{kind}_devices must be a positive integer, got {count!r}")
        if island is not None and (not isinstance(island, int) or isinstance(island, bool)):
            raise PlacementError(f"island= takes an island's id (an integer), not {island!r}: `python -m pathways "
                                 "status` shows each island's id beside its name, as in `island a (id 0)`")
        try:
            reply = self._session.request(lambda req: m.SliceRequest(
                req, kind, count, tuple(mesh_shape) if mesh_shape else None, island, exclusive))
        except PlacementError as e:
            if not self._session.local:
                raise
            # only this process can start the cluster again, larger: the controller cannot know it
            raise PlacementError(f"{e}. This is a local cluster of CPU workers that this process started: start "
                                 "it with the devices the program needs, e.g. "
                                 "pw.local_cluster(islands=[pw.Island(hosts=H, devices_per_host=D)])") from None
        flat = reply.devices
        s = Slice(self._session, reply.slice, kind, count, reply.mesh_shape, reply.island,
                  reply.workers, reply.addresses, tuple(zip(flat[::2], flat[1::2])))
        self.slices.append(s)
        self._session.slices[s.id] = s
        return s


@dataclass(eq=False, repr=False)  # a slice is itself: equal, and hashed, by identity
class Slice:
    session: Any
    id: int
    kind: str
    count: int
    mesh_shape: tuple[int, ...]
    island: int
    workers: tuple[int, ...]  # the hosts holding the slice (several for a multi-host slice)
    addresses: tuple[str, ...]
    _physical: tuple[tuple[int, int], ...]

    def move(self, workers: tuple[int, ...], addresses: tuple[str, ...], island: int,
             physical: tuple[tuple[int, int], ...]) -> None:
        """The controller placed this slice anew (messages.SliceMoved): its island healed,
        or its session resumed elsewhere. Arrays and functions on it follow, since they
        look the slice's hosts up when they use them."""
        self.workers, self.addresses, self.island, self._physical = workers, addresses, island, physical

    @property
    def devices(self) -> "VirtualDevices":
        return VirtualDevices(VirtualDevice(self, i) for i in range(self.count))._bind(self)

    def _of_kind(self, kind: str) -> "VirtualDevices":
        if self.kind != kind:
            raise PlacementError(f"slice {self.id} holds {self.kind} devices, not {kind}; use .devices")
        return self.devices

    @property
    def cpus(self) -> "VirtualDevices":
        return self._of_kind("cpu")

    @property
    def gpus(self) -> "VirtualDevices":
        return self._of_kind("gpu")

    @property
    def tpus(self) -> "VirtualDevices":
        return self._of_kind("tpu")

    def mesh(self, axis_names: Sequence[str] | str) -> "VirtualMesh":
        """A mesh over this slice's devices, shaped by the slice's ``mesh_shape``."""
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if len(names) != len(self.mesh_shape):
            raise PlacementError(f"slice {self.id} has mesh shape {self.mesh_shape}, so its mesh "
                                 f"needs {len(self.mesh_shape)} axis name(s); got {names}. "
                                 "Pass mesh_shape= to add_slice for another shape")
        return VirtualMesh(self, self.mesh_shape, names)

    def layout(self, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], spec: PartitionSpec) -> Layout:
        entries = tuple(tuple(e) if isinstance(e, (tuple, list)) else e for e in spec)
        return Layout(self.workers, self._physical, mesh_shape, axis_names, entries)

    def __repr__(self) -> str:
        return (f"Slice(id={self.id}, {self.count} {self.kind}, mesh_shape={self.mesh_shape}, "
                f"island={self.island}, hosts={len(self.workers)})")


@dataclass(frozen=True)
class VirtualDevice:
    slice: Slice
    index: int

    def __repr__(self) -> str:
        return f"VirtualDevice(slice={self.slice.id}, index={self.index}, kind={self.slice.kind})"


class VirtualDevices(tuple):
    """The devices of one slice; what ``pw.pmap(devices=...)`` takes."""

    slice: Slice

    def _bind(self, s: Slice) -> "VirtualDevices":
        self.slice = s
        return self


@dataclass(frozen=True)
class VirtualMesh:
    slice: Slice
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.slice.count

    def axis_size(self, names: str | tuple[str, ...] | None) -> int:
        n = 1
        for name in (() if names is None else (names,) if isinstance(names, str) else names):
            n *= self.shape[self.axis_names.index(name)]
        return n


@dataclass(frozen=True)
class NamedSharding:
    """How an array is laid out over a virtual mesh: ``pw.NamedSharding(mesh, P('x'))``."""

    mesh: VirtualMesh
    spec: PartitionSpec

    def layout(self) -> Layout:
        return self.mesh.slice.layout(self.mesh.shape, self.mesh.axis_names, self.spec)


def slice_of(devices: object, what: str) -> Slice:
    """The slice behind ``devices``: a slice's ``.devices``, a Slice, or a VirtualMesh."""
    if isinstance(devices, Slice):
        return devices
    if isinstance(devices, VirtualMesh):
        return devices.slice
    if isinstance(devices, VirtualDevices) and hasattr(devices, "slice"):
        return devices.slice
    raise PlacementError(f"{what} must be the .devices of a slice from pw.make_virtual_device_set()"
                         f".add_slice(...), got {type(devices).__name__}")
