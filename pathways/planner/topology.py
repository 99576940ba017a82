"""The cluster a plan is made for: devices (memory, speed) and the links between them.

The planners need only three facts per device (how much it holds, how fast it computes,
what it is) and two per link (latency and bandwidth), so a topology can be written by hand
in JSON, built in a test, or read from a running cluster's status (``from_status``).
Everything is validated on construction so that a planner never meets a negative
bandwidth or a link to a device that does not exist halfway through a solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from pathways.errors import PathwaysError


class PlanError(PathwaysError, ValueError):
    """A planning input is invalid or cannot be satisfied; the message says which and what to do."""


class UnknownLinkError(PlanError, KeyError):
    """No link is known between two devices and the topology has no default link."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Device:
    """One device a plan may use: ``flops`` is its speed in FLOP/s, ``memory_bytes`` what it holds."""

    id: str
    memory_bytes: int
    flops: float
    kind: str = "cpu"


@dataclass(frozen=True)
class Link:
    """A link between two devices: moving ``n`` bytes takes ``latency + n / bandwidth`` seconds."""

    latency: float  # seconds
    bandwidth: float  # bytes/s


def _check_number(value: Any, what: str, *, positive: bool, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise PlanError(f"{what} must be {kind}, got {value!r}")
    if not math.isfinite(value):
        raise PlanError(f"{what} must be finite, got {value!r}")
    if positive and value <= 0:
        raise PlanError(f"{what} must be positive, got {value!r}")
    if not positive and value < 0:
        raise PlanError(f"{what} must not be negative, got {value!r}")


def _check_amount(value: Any, what: str, integer: bool = False, noun: str = "") -> None:
    """``value`` is a count or a quantity of work or time: a finite number (an integer if
    ``integer``) >= 0; ``noun`` names it in the error (default: "an integer" or "a finite
    number")."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok_type or value < 0:
        noun = noun or ("an integer" if integer else "a finite number")
        raise PlanError(f"{what} must be {noun} >= 0, got {value!r}")


def _check_link(link: Any, what: str) -> None:
    if not isinstance(link, Link):
        raise PlanError(f"{what} must be a Link, got {type(link).__name__}")
    _check_number(link.latency, f"{what}.latency", positive=False)
    _check_number(link.bandwidth, f"{what}.bandwidth", positive=True)


class Topology:
    """Devices and the links between them.

    ``links`` maps an ordered pair of device ids to its link; a pair given once serves both
    directions unless the reverse pair is given too. ``default_link`` serves every pair
    that is not listed (for example a uniform network).
    """

    def __init__(self, devices: Sequence[Device], links: Mapping[tuple[str, str], Link] = {},
                 default_link: Link | None = None) -> None:
        devices = tuple(devices)
        seen: dict[str, Device] = {}
        for i, d in enumerate(devices):
            if not isinstance(d, Device):
                raise PlanError(f"devices[{i}] must be a Device, got {type(d).__name__}")
            if not isinstance(d.id, str) or not d.id:
                raise PlanError(f"devices[{i}].id must be a non-empty string, got {d.id!r}")
            if d.id in seen:
                raise PlanError(f"device id {d.id!r} appears twice in devices; give every device its own id")
            _check_number(d.memory_bytes, f"device {d.id!r} memory_bytes", positive=True, integer=True)
            _check_number(d.flops, f"device {d.id!r} flops", positive=True)
            if not isinstance(d.kind, str):
                raise PlanError(f"device {d.id!r} kind must be a string, got {d.kind!r}")
            seen[d.id] = d
        checked: dict[tuple[str, str], Link] = {}
        for pair, link in dict(links).items():
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise PlanError(f"link key {pair!r} must be a pair (src, dst) of device ids")
            for end in pair:
                if end not in seen:
                    raise PlanError(f"link {pair[0]!r} -> {pair[1]!r} names unknown device {end!r}; "
                                    f"known devices: {sorted(seen)}")
            _check_link(link, f"link {pair[0]!r} -> {pair[1]!r}")
            checked[pair] = link
        if default_link is not None:
            _check_link(default_link, "default_link")
        self.devices: tuple[Device, ...] = devices
        self.links: dict[tuple[str, str], Link] = checked
        self.default_link: Link | None = default_link
        self._by_id = seen

    def __repr__(self) -> str:
        return f"Topology({len(self.devices)} devices, {len(self.links)} links, default_link={self.default_link})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Topology) and self.devices == other.devices and self.links == other.links
                and self.default_link == other.default_link)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking container: compare, do not hash

    def device(self, id: str) -> Device:
        """The device called ``id``."""
        try:
            return self._by_id[id]
        except KeyError:
            raise PlanError(f"unknown device {id!r}; known devices: {sorted(self._by_id)}") from None

    def link(self, a: str, b: str) -> Link:
        """The link from ``a`` to ``b``: the pair as given, else the reverse pair, else the default."""
        self.device(a)
        self.device(b)
        found = self.links.get((a, b)) or self.links.get((b, a)) or self.default_link
        if found is None:
            raise UnknownLinkError(f"no link between devices {a!r} and {b!r}: add one to the topology's links "
                                   "or give it a default_link")
        return found

    def transfer_time(self, a: str, b: str, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from ``a`` to ``b``; nothing moves when they are the same device."""
        if a == b:
            self.device(a)
            return 0.0
        link = self.link(a, b)
        return link.latency + nbytes / link.bandwidth

    def to_dict(self) -> dict:
        """The JSON form read back by ``from_dict`` (and by the planner's command line)."""
        out: dict[str, Any] = {
            "devices": [{"id": d.id, "memory_bytes": d.memory_bytes, "flops": d.flops, "kind": d.kind}
                        for d in self.devices],
            "links": [{"src": a, "dst": b, "latency": link.latency, "bandwidth": link.bandwidth}
                      for (a, b), link in self.links.items()],
        }
        if self.default_link is not None:
            out["default_link"] = {"latency": self.default_link.latency,
                                   "bandwidth": self.default_link.bandwidth}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        """Read the ``to_dict`` form; a missing key or a wrong type raises ``PlanError`` naming it."""
        if not isinstance(d, dict):
            raise PlanError(f"a topology must be a JSON object, got {type(d).__name__}")
        devices = []
        for where, item in _objects(_field(d, "devices", list, "topology"), "devices"):
            devices.append(Device(id=_field(item, "id", str, where),
                                  memory_bytes=_field(item, "memory_bytes", int, where),
                                  flops=_field(item, "flops", (int, float), where),
                                  kind=item.get("kind", "cpu")))
        links = {}
        for where, item in _objects(d.get("links", []), "links"):
            pair = (_field(item, "src", str, where), _field(item, "dst", str, where))
            links[pair] = _link(item, where)
        default = d.get("default_link")
        return cls(devices, links, None if default is None else _link(default, "default_link"))

    @classmethod
    def from_status(cls, status: dict) -> Topology:
        """The topology of a running cluster, one device per worker host, from its status dict.

        A worker's speed (``flops``) and the links are measured by the cluster; a worker
        not measured yet cannot be planned for, so that raises rather than guessing.
        """
        if not isinstance(status, dict) or not isinstance(status.get("workers"), list):
            raise PlanError("the cluster status has no 'workers' list; pass the dict returned by "
                            "pathways.cluster.status(address)")
        devices = []
        for where, w in _objects(status["workers"], "status['workers']", "a dict"):
            wid = _field(w, "worker", int, where)
            flops = w.get("flops")
            if not flops:
                raise PlanError(f"worker {wid} has no measured flops: the cluster has not measured it yet; "
                                "retry after the measurement (python -m pathways status --measure)")
            devices.append(Device(id=str(wid), memory_bytes=_field(w, "memory_bytes", int, where),
                                  flops=_field(w, "flops", (int, float), where),
                                  kind=_field(w, "kind", str, where)))
        links = {}
        for where, item in _objects(status.get("links", []), "status['links']", "a dict"):
            links[(str(_field(item, "src", int, where)), str(_field(item, "dst", int, where)))] = _link(item, where)
        return cls(devices, links)


def _objects(items: Any, name: str, noun: str = "an object") -> Iterator[tuple[str, dict]]:
    """Each element of the list ``items`` with its name in errors (``name[i]``), checked to
    be a dict."""
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise PlanError(f"{where} must be {noun}, got {type(item).__name__}")
        yield where, item


def _nonempty(items: Any, name: str, kind: type, noun: str, need: str) -> tuple:
    """``items`` as a tuple, refused when empty (``need`` says what to give) or when an
    element is not a ``kind`` (``noun`` names one in errors about ``name[i]``)."""
    items = tuple(items)
    if not items:
        raise PlanError(f"{name} is empty: {need}")
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise PlanError(f"{name}[{i}] must be {noun}, got {type(item).__name__} {item!r:.80}")
    return items


def _check_topology(topology: Any, purpose: str) -> None:
    """``topology`` is a Topology with at least one device to ``purpose`` on."""
    if not isinstance(topology, Topology):
        raise PlanError(f"topology must be a Topology, got {type(topology).__name__}")
    if not topology.devices:
        raise PlanError(f"the topology has no devices: add at least one device to {purpose}")


def _check_time_limit(time_limit: Any) -> None:
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise PlanError(f"time_limit must be a positive number of seconds, got {time_limit!r}")


def _field(d: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    """``d[key]``, checked to be of ``types``; ``where`` names ``d`` in errors ("" at top level)."""
    if key not in d:
        raise PlanError(f"{where} has no {key!r}" if where else f"missing {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise PlanError(f"{where + '.' if where else ''}{key} must be {names}, got {value!r}")
    return value


def _link(item: Any, where: str) -> Link:
    if not isinstance(item, dict):
        raise PlanError(f"{where} must be an object, got {type(item).__name__}")
    return Link(latency=_field(item, "latency", (int, float), where),
                bandwidth=_field(item, "bandwidth", (int, float), where))
