"""Worker membership: who is attached, where they are reached, what they measured.

Workers register on their stream (framed TCP) and join their island (islands.py assigns
ranks and the island's coordinator; a registration that does not fit is refused with a
Shutdown that says what to fix), get an id, a data-plane key, and every peer's data-plane
address with the ticket that opens it (messages.data_ticket: only workers the controller
admitted can send each other transfer copies); the
resource manager learns their devices, and keeps slices off islands that are not healthy
(the islands registry owns their health). A
lost worker takes its island with it until the island heals (islands.py; what that means
for runs, arrays and slices is the core's business, see core.py). Workers also
report what they measured about themselves (FLOP/s, memory, their links to each other);
``measure`` asks them to measure again, one at a time, so that their probes and matmuls do
not disturb each other's figures. Single-threaded; sends only through outboxes.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from pathways.controller.islands import Refused
from pathways.controller.placement import ResourceManager
from pathways.protocol import messages as m
from pathways.wire import tcp

log = logging.getLogger("pathways.controller")

MAX_WORKERS = 4096  # attached at once; bounds the peers list and status


class MessageSink(Protocol):
    """Where messages to one worker or session go (a stream's outbox, or a test's list)."""

    def put(self, message: m.Message) -> None: ...


@dataclass
class WorkerConn:
    """One worker stream; ``worker`` is -1 until it registers, and ``island`` (an id) and
    ``rank`` are what the controller assigned it."""

    outbox: MessageSink
    worker: int = -1
    info: m.Register | None = None
    island: int = -1
    rank: int = -1
    defined: set[int] = field(default_factory=set)  # program keys sent to it
    retired: bool = False  # its island was lost: whatever it still sends is stale (its id may be reused)
    heartbeat: float | None = None  # the silence, in seconds, after which the worker gives up on the controller
    data_key: bytes = b""  # checks the tickets of the worker's data-plane peers (drawn when it registers)
    # Seconds the worker had been silent, past the heartbeat timeout, when the shell last
    # looked, while its host still acknowledges (slow, not lost); None while it answers.
    silent: float | None = None

    def describe(self) -> str:
        """The worker as an operator finds it: id, host name, advertised address, pid, island."""
        if self.info is None:
            return "an unregistered worker"
        return (f"worker {self.worker} on host {self.info.host} at {self.info.address} "
                f"(pid {self.info.pid}, island {self.info.island})")

    @property
    def address(self) -> str:
        return self.info.address if self.info else ""


@dataclass
class Measurement:
    """A request to measure again: the workers yet to report, in the order they are asked
    (the first is measuring now), and what to call when none is left."""

    waiting: list[int]
    done: Callable[[], None]


def _own_ticket(data_key: bytes) -> tuple[int, bytes]:
    """What this controller shows the data listener of the worker whose key is ``data_key``."""
    return m.CONTROLLER_SENDER, m.data_ticket(data_key, m.CONTROLLER_SENDER)


class Membership:
    def __init__(self, rm: ResourceManager) -> None:
        self.rm = rm
        self.islands = rm.islands
        self.workers: dict[int, WorkerConn] = {}
        self.links: dict[tuple[int, int], tuple[float, float]] = {}  # (src, dst) -> (latency s, bytes/s)
        self._measurements: dict[int, Measurement] = {}
        self._measurement_ids = itertools.count(1)
        self._next_worker = 0
        # worker gRPC address -> how this process reaches its data listener (the IFRT front
        # end's puts, from its own threads: they only get entries, and setting or deleting
        # one is atomic)
        self.data_routes: dict[str, tcp.Route] = {}

    def register(self, conn: WorkerConn, msg: m.Register, copies: int = 0) -> bool:
        """Admit a worker to its island (see islands.py), or refuse it with a Shutdown that
        says why (False); welcome it once its island's coordinator is known. ``copies``: the
        next transfer copy handle the controller will give (WorkerWelcome.copies)."""
        if conn.worker >= 0:
            conn.outbox.put(m.Notice("worker is already registered"))
            return False
        if len(self.workers) >= MAX_WORKERS:
            conn.outbox.put(m.Shutdown(f"the controller already has {MAX_WORKERS} workers; start another "
                                       "controller for more"))
            return False
        fresh = self._next_worker
        try:
            island, worker, rank, welcome = self.islands.join(fresh, msg.island, msg.island_hosts, msg.rank,
                                                              msg.coordinator, f" on {msg.host} (pid {msg.pid})")
        except Refused as e:
            log.warning("refused a worker at %s: %s", msg.address, e)
            conn.outbox.put(m.Shutdown(str(e)))
            return False
        if worker == fresh:
            self._next_worker += 1
        conn.worker, conn.info, conn.island, conn.rank = worker, msg, island.id, rank
        conn.data_key = secrets.token_bytes(m.DATA_KEY_BYTES)
        self.workers[worker] = conn
        self.data_routes[msg.address] = tcp.Route(msg.data_address, msg.data_tls, _own_ticket(conn.data_key))
        self.rm.add_host(worker, island.id, msg.kind, msg.devices, msg.memory_bytes, rank)
        for w, r in welcome:
            self.workers[w].outbox.put(m.WorkerWelcome(w, island.id, r, island.coordinator, copies))
        # the newcomer learns every peer; the others learn only the newcomer (peers add up on
        # a worker), so that n registrations send O(n) addresses, not O(n^2)
        conn.outbox.put(m.DataKey(worker, conn.data_key))
        conn.outbox.put(m.Peers(tuple((w.worker, w.info.data_address, m.data_ticket(w.data_key, worker))
                                      for w in self.workers.values())))
        for w in self.workers.values():
            if w is not conn:
                w.outbox.put(m.Peers(((worker, msg.data_address, m.data_ticket(conn.data_key, w.worker)),)))
        log.info("worker %d registered: %d %s device(s) at %s, rank %d of island %s (%d of %d host(s) joined)",
                 worker, msg.devices, msg.kind, msg.address, rank, island.describe(), len(island.members),
                 island.hosts)
        return True

    def lose_island(self, island: int, why: str) -> set[int]:
        """The island lost a host (``why``: which, and how): it is lost, and the resource
        manager forgets its hosts, whose worker ids are returned (the core removes them)."""
        self.islands.lose(island, why)
        return self.rm.lose_island(island)

    def remove(self, worker: int) -> WorkerConn | None:
        """Forget ``worker``: its links, and its turn in any measurement."""
        conn = self.workers.pop(worker, None)
        if conn is None:
            return None
        conn.retired = True
        route = self.data_routes.get(conn.address)
        if route is not None and route.ticket == _own_ticket(conn.data_key):  # not a successor's at that address
            del self.data_routes[conn.address]
        self.links = {pair: figures for pair, figures in self.links.items() if worker not in pair}
        for mid in list(self._measurements):
            self._measured_by(mid, worker)
        return conn

    def gone(self, workers: Iterable[int]) -> list[int]:
        """Those of ``workers`` that are no longer attached."""
        return [w for w in workers if w not in self.workers]

    def unavailable(self, workers: Iterable[int]) -> list[int]:
        """Those of ``workers`` that cannot run anything now: not attached, or on an island
        that is not healthy (a host of a healing island joined again before the others)."""
        return [w for w in workers if w not in self.workers or not self.islands.healthy(self.workers[w].island)]

    def healing(self, workers: Iterable[int]) -> str:
        """What became of the islands of ``workers`` (gone, or on an island not yet whole):
        each island by name, which host it lost and why, and how many hosts joined again."""
        wanted = set(workers)
        notes = [f"island {island.describe()} is healing ({island.lost_by or 'it lost a host'}; "
                 f"{self.islands.recovery(island)})"
                 for island in self.islands.by_id.values()
                 if not island.healthy and wanted & {*island.former.values(), *island.members.values()}]
        return "; ".join(notes) or "their island was lost"

    # ---- measurements ------------------------------------------------------------------

    def measure(self, done: Callable[[], None]) -> int:
        """Have every worker measure itself again, one at a time; ``done()`` is called once
        all have reported or were lost. Returns the request's id."""
        mid = next(self._measurement_ids)
        self._measurements[mid] = Measurement(sorted(self.workers), done)
        self._ask_next(mid)
        return mid

    def abandon_measurement(self, mid: int) -> list[int]:
        """Stop measurement ``mid``; returns the workers that did not report, the first of
        them the one measuring (the others were not asked yet)."""
        req = self._measurements.pop(mid, None)
        return list(req.waiting) if req is not None else []

    def measured(self, conn: WorkerConn, msg: m.Measured) -> None:
        if conn.worker < 0:
            conn.outbox.put(m.Notice("a worker reports measurements after it registers"))
            return
        if conn.worker not in self.workers:  # its island was lost meanwhile
            return
        if msg.flops is not None:
            self.rm.set_flops(conn.worker, msg.flops)
        self.rm.hosts[conn.worker].memory_bytes = msg.memory_bytes
        for peer, latency, bandwidth in msg.links:
            if peer == conn.worker:
                conn.outbox.put(m.Notice(f"worker {peer} reported a link to itself; a link joins two workers"))
                continue
            if peer not in self.workers:
                continue
            if latency is None:
                self.links.pop((conn.worker, peer), None)
            else:
                self.links[(conn.worker, peer)] = (latency, bandwidth)
            self.rm.set_latency(conn.worker, peer, latency)
        self._measured_by(msg.id, conn.worker)

    def _measured_by(self, mid: int, worker: int) -> None:
        req = self._measurements.get(mid)
        if req is None:
            return
        measuring = req.waiting[0]
        req.waiting = [w for w in req.waiting if w != worker]
        if measuring == worker:
            self._ask_next(mid)

    def _ask_next(self, mid: int) -> None:
        req = self._measurements[mid]
        req.waiting = [w for w in req.waiting if w in self.workers]
        if not req.waiting:
            del self._measurements[mid]
            req.done()
            return
        self.workers[req.waiting[0]].outbox.put(m.Measure(mid))
