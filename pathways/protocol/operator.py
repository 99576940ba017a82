"""The replies of the operator's unary methods: the controller's Status, Measure, Retire and
AttachAddress, a worker's Stats and Timeline, and the IFRT front end's admission check. Each
is a typed message, checked on the way in like every control message, or ``Failed`` (an
error and its kind, which the caller raises as the matching ``pw.*Error``).

The cluster's status (``ClusterStatus``) is declared with the session stream's messages,
which carry it too. ``as_dict`` gives the maps users read (``pw.cluster.status``, JSON on
the command line), built from the checked records, never from a raw payload.
"""

from __future__ import annotations

from typing import Any

from pathways.errors import WireError
from pathways.protocol.check import Bool, Custom, Fixed, Int, Optional, Seq, Str
from pathways.protocol.errors import KINDS, error_of
from pathways.protocol.handles import MAX_SESSION
from pathways.protocol.messages import (COUNT, HEALTH_STATES, MAX_ISLAND, MAX_ISLAND_NAME, NAME, TEXT, WORKER,
                                        WORKERS, ClusterStatus, ColocatedDone, Message, Profiled, Record, Saved, Table,
                                        Timeline, int_map, message, wire)
from pathways.wire.codec import pack, unpack

RETIRED_WAS = frozenset({*HEALTH_STATES, "forgotten"})


@message("retired")
class Retired(Message):
    """What an operator's retire did (controller/retiring.py): ``island`` (its name) and
    ``id``; ``worker`` the one host retired, if one; ``hosts`` the workers shut down;
    ``runs_cut`` the runs still there when it was retired; ``slices_released``; ``sessions``
    those that had slices there; ``was`` its state before (a health, or "forgotten" or
    "lost" when that happened while it drained); ``drained`` whether its runs finished
    within the timeout."""

    island: str = wire(Str(MAX_ISLAND_NAME))
    id: int = wire(Int(0, MAX_ISLAND))
    worker: int | None = wire(Optional(WORKER))
    hosts: tuple[int, ...] = wire(WORKERS)
    runs_cut: int = wire(COUNT)
    slices_released: int = wire(COUNT)
    sessions: tuple[int, ...] = wire(Seq(Int(1, MAX_SESSION)))
    was: str = wire(Str(16, RETIRED_WAS))
    drained: bool = wire(Bool())


@message("attach")
class AttachAddress(Message):
    """Where workers attach: ``address`` ("tcp://HOST:PORT") and its ``port``."""

    address: str = wire(NAME)
    port: int = wire(Int(1, 65535))


@message("stats")
class WorkerStats(Message):
    """One worker's counts: arrays (``handles``, and per session, session 0 being the
    controller's transfer copies), the bytes each session holds and the quota
    (``session_memory``, 0: none), executables and those compiled, the compile cache's
    hits and misses, programs, data-plane connections refused for want of a ticket and
    transfer copies refused for want of a run expecting them."""

    worker: int = wire(WORKER)
    handles: int = wire(COUNT)
    sessions: dict[int, int] = wire(int_map(Int(0, MAX_SESSION), COUNT))
    session_bytes: dict[int, int] = wire(int_map(Int(0, MAX_SESSION), COUNT))
    session_memory: int = wire(COUNT)
    executables: int = wire(COUNT)
    compiled: int = wire(COUNT)
    cache_hits: int = wire(COUNT)
    cache_misses: int = wire(COUNT)
    programs: int = wire(COUNT)
    refused_peers: int = wire(COUNT)
    refused_copies: int = wire(COUNT)

    def as_dict(self) -> dict[str, Any]:
        out = Record.as_dict(self)
        out["compile_cache"] = {"hits": out.pop("cache_hits"), "misses": out.pop("cache_misses")}
        return out


@message("failed")
class Failed(Message):
    """An operator's request that failed: what happened, and its kind (errors.py)."""

    error: str = wire(TEXT)
    kind: str = wire(Str(32, frozenset(KINDS)))

    def raised(self, default: type = WireError) -> Exception:
        return error_of(self.kind, self.error, default)


MAX_INIT_ENTRIES = 256
INIT_DATA = Custom(lambda raw: dict(Seq(Fixed(NAME, TEXT), max_len=MAX_INIT_ENTRIES).check(raw, "initialization data")),
                   lambda d: [[k, v] for k, v in d.items()])


@message("admission")
class AdmissionCheck(Message):
    """Would the IFRT front end admit a session with this initialization data (each key
    and value as text)? ``pathways.ifrt.plugin`` asks before its client connects, so that a
    refusal is said at once instead of after the client's own connection timeout."""

    init_data: dict[str, str] = wire(INIT_DATA)


@message("admitted")
class Admission(Message):
    """Why such a session would be refused, or None: it would be admitted."""

    refused: str | None = wire(Optional(TEXT))


STATUS_REPLY = Table("status reply", ClusterStatus, Failed)
RETIRE_REPLY = Table("retire reply", Retired, Failed)
ATTACH_REPLY = Table("attach address reply", AttachAddress)
STATS_REPLY = Table("stats reply", WorkerStats, Failed)
TIMELINE_REPLY = Table("timeline reply", Timeline, Failed)
SAVED_REPLY = Table("save or load reply", Saved, Failed)
COLOCATED_REPLY = Table("colocated reply", ColocatedDone, Failed)
PROFILED_REPLY = Table("profile reply", Profiled, Failed)
ADMISSION_CHECK = Table("admission check", AdmissionCheck)
ADMISSION_REPLY = Table("admission reply", Admission)


def reply(msg: Message) -> bytes:
    """A unary reply's payload."""
    return pack(msg.encode())


def answer(table: Table, payload: bytes, default: type = WireError) -> Message:
    """The reply ``payload`` read as one of ``table``'s kinds; a ``Failed`` one is raised
    as its kind's error (``default`` for a kind it does not name)."""
    msg = table.decode(unpack(payload))
    if type(msg) is Failed:
        raise msg.raised(default)
    return msg
