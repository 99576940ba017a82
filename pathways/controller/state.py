"""The records the controller core keeps: each client session's state (SessionState) and
each retirement an operator asked for (Retirement)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pathways.controller.handles import HandleTable
from pathways.controller.islands import IslandRecord
from pathways.controller.membership import MessageSink, WorkerConn
from pathways.controller.programs import SessionPrograms
from pathways.controller.scheduler import ScheduledRun
from pathways.controller.suspension import Suspension


@dataclass
class SessionState:
    outbox: MessageSink
    credential: bytes  # the secret workers ask of this session's puts and fetches
    slices: set[int] = field(default_factory=set)
    handles: HandleTable = field(default_factory=HandleTable)
    programs: SessionPrograms = field(default_factory=SessionPrograms)
    traced_workers: set[int] = field(default_factory=set)  # workers that ran its traced runs
    tail: ScheduledRun | None = None  # the latest run submitted to the scheduler, which may take on the next
    suspension: Suspension | None = None  # from its Suspend request until it has resumed
    moved: list[frozenset[int]] = field(default_factory=list)  # the workers each SliceMoved sent it named
    released: dict[int, str] = field(default_factory=dict)  # slice -> why: its island was retired or forgotten


@dataclass
class Retirement:
    """An operator's request to retire ``island``, or one host of it (``host``), while its
    runs drain; ``done()`` is called once they have (``drained``)."""

    id: int
    island: IslandRecord
    host: WorkerConn | None
    done: Callable[[], None]
    drained: bool = False

    def describe(self) -> str:
        return self.host.describe() if self.host is not None else f"island {self.island.describe()}"
