"""The controller's core: typed messages in, typed messages out. Every call runs on the
transport's event-loop thread; sending goes through outboxes (anything with
``put(message)``), so nothing here does I/O and all of it runs without processes. One
reader on other threads: the IFRT front end's data-plane pool looks up a worker's data
address in ``membership.data_routes``, a dict lookup, atomic under the GIL.

It composes parts with one job each: worker membership and measurements
(membership.py), placement (placement.py), each session's handle table (handles.py) and
programs with their lowerings (programs.py), dispatch through the gang scheduler
(dispatch.py, scheduler.py), and the suspend and resume of sessions (suspension.py). The
transport shell (server.py) decodes payloads with the protocol's tables and calls
``on_session_batch`` / ``on_worker_batch``; a second front end drives a session through
the same typed messages with ``on_session_message``. Islands that lost a host heal when
their hosts join again (``worker_lost``, ``_healed``); an operator retires an island or a
host for good (``retire``, then ``finish_retirement`` once its runs drained or the shell's
wait ran out), and lost islands nobody rejoins are forgotten beyond MAX_LOST_ISLANDS.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

from pathways.controller.dispatch import Dispatch, Dispatcher, coalesce
from pathways.controller.handles import HandleTable
from pathways.controller.islands import Health, IslandRecord, Islands, Recovery
from pathways.controller.lowering import FnLayouts
from pathways.controller.membership import MAX_WORKERS, Membership, MessageSink, WorkerConn
from pathways.controller.placement import ResourceManager, SlicePlacement
from pathways.controller.programs import RunFailure, SessionPrograms, XlaCompile
from pathways.controller.scheduler import DEFAULT_WINDOW, ScheduledRun, Scheduler
from pathways.controller.status import status
from pathways.controller.suspension import DRAINING, OFFLOADING, RESUMING, SUSPENDED, Remap, Suspension
from pathways.controller.transfers import plan
from pathways.errors import AccessDeniedError, PathwaysError, PlacementError, SuspendedError, WireError, WorkerLostError
from pathways.ir import Layout, ProgramGraph
from pathways.protocol import messages as m
from pathways.protocol.check import clip_text
from pathways.protocol.errors import DENIED, LOST, REMOTE, STUCK, SUSPENDED as SUSPENDED_KIND, kind_of
from pathways.protocol.handles import first_handle, fits, session_of
from pathways.timeline import RECORDER, now

log = logging.getLogger("pathways.controller")

# Lost islands that no host has rejoined which the controller remembers (status lists them
# as unhealthy); beyond it the oldest loss is forgotten.
MAX_LOST_ISLANDS = 64

__all__ = ["ControllerCore", "WorkerConn", "MessageSink", "Retirement"]


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


class ControllerCore:
    """``run_timeout``: seconds an island with runs in flight may go without finishing one
    before ``check_stuck_runs`` resets it (None: never); ``clock`` times it."""

    def __init__(self, policy: str = "fair", window: int = DEFAULT_WINDOW, run_timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic, recovery: Recovery = Recovery.ELSEWHERE) -> None:
        self.islands = Islands(recovery)  # the one owner of island health
        self.rm = ResourceManager(self.islands)
        self.scheduler = Scheduler(policy, window)
        self.membership = Membership(self.rm)
        self.dispatcher = Dispatcher(self.scheduler, self.membership, clock)
        self.run_timeout = run_timeout
        self.sessions: dict[int, SessionState] = {}
        self._next_copy = first_handle(0) + 1  # transfer copies are the controller's handles
        self._draining: set[int] = set()  # sessions suspending that wait for their runs to finish
        self._retirements: dict[int, Retirement] = {}
        self._retirement_ids = itertools.count(1)
        # worker -> why it is gone for good (its island retired or forgotten), for the
        # errors of sessions that still use it; the latest MAX_WORKERS
        self._gone_why: dict[int, str] = {}

    @property
    def workers(self) -> dict[int, WorkerConn]:
        return self.membership.workers

    # ---- workers ---------------------------------------------------------------------

    def on_worker_batch(self, conn: WorkerConn, payload: bytes) -> None:
        try:
            batch = m.WORKER_UP.decode_batch(payload)
        except WireError as e:
            conn.outbox.put(m.Notice(f"controller dropped a batch: {e}"))
            return
        for msg in batch:
            self.on_worker_message(conn, msg)

    def on_worker_message(self, conn: WorkerConn, msg: Union[m.Message, m.Malformed]) -> None:
        if conn.retired:  # a host of a lost island, told to restart: its id may already be a newcomer's
            return
        kind = type(msg)
        if kind is m.Done:
            self.dispatcher.done(conn, msg.runs)
            self._pump()
            if self._draining:
                self._drained()
            if self._retirements:
                self._check_retiring()
        elif kind is m.Step:
            self.dispatcher.step(conn, msg.run, msg.node)
        elif kind is m.Register:
            if self.membership.register(conn, msg, self._next_copy):
                # in the order they opened: a worker takes a session that is not open and
                # older than the newest it heard of as closed (worker/sessions.py)
                for sid in sorted(self.sessions):
                    conn.outbox.put(self._session_open(sid, conn))
                island = self.islands.by_id[conn.island]
                if island.health is Health.HEALING and island.assembled:
                    self._healed(island.id)
        elif kind is m.Measured:
            self.membership.measured(conn, msg)
        elif kind is m.Compiled:
            self._compiled(conn, msg)
        elif kind is m.Offloaded:
            self._offloaded(conn, msg)
        elif kind is m.Undelivered:
            self._undelivered(conn, msg)
        elif kind is m.Adopted:
            self._adopted(conn, msg)
        elif kind is m.Heartbeat:
            conn.heartbeat = msg.timeout  # the shell paces its heartbeats to it
        elif kind is m.Notice:
            log.warning("worker %s reported: %s", conn.worker, msg.message)
        else:  # Malformed
            conn.outbox.put(m.Notice(f"controller dropped {msg.tag!r}: {msg.error}"))

    def worker_lost(self, conn: WorkerConn, silent_for: float | None = None, error: str | None = None) -> None:
        """A worker's stream ended: its connection closed (``error``: the one that ended it,
        if one did), or (``silent_for`` seconds) the worker stopped answering and the shell
        dropped it (``error``: what else the shell knew, e.g. that its host stopped
        acknowledging too). Its island is unhealthy until it heals (whether it had assembled or
        not): a multi-host group cannot run without one of its hosts, so every run, array
        and future that involves any host of the island fails with WorkerLostError naming
        the worker, and the surviving hosts of the island are told to restart and join it
        again (a fresh jax.distributed group needs fresh processes), with whatever replaces
        the lost host (``_healed``). Other islands keep serving."""
        if conn.retired or self.workers.get(conn.worker) is not conn:
            return
        if silent_for is not None:
            why = f"it stopped answering for {silent_for:.1f} s" + (f", and {error}" if error else "")
        elif error is not None:
            why = f"its connection closed (the process exited or was killed, or the connection was cut: {error})"
        else:
            why = "its connection closed (the process exited or was killed)"
        self._lose_host(conn, why)

    def _lose_host(self, conn: WorkerConn, why: str) -> None:
        """``conn``'s island lost it (``why``: how): see ``worker_lost``."""
        island = conn.island
        name = self.islands.by_id[island].describe()
        lost_worker = f"{conn.describe()} was lost: {why}"
        log.warning("%s", lost_worker)
        lost = self.membership.lose_island(island, lost_worker) | {conn.worker}
        message = (f"{lost_worker}; arrays and computations on island {name} are gone. The island heals once a "
                   "host replaces the lost one (a worker started with the same --island; its other hosts rejoin "
                   "on their own), and its slices and compiled functions then work again; meanwhile use a "
                   "healthy island (`python -m pathways status` shows which are healthy)")
        self._cut(lost, message)
        for w in lost:
            survivor = self.membership.remove(w)
            if survivor is not None and survivor is not conn:
                survivor.outbox.put(m.Reset(message))
        self._after_loss(lost, message)
        self._forget_old_losses()

    def _undelivered(self, conn: WorkerConn, msg: m.Undelivered) -> None:
        """Worker ``conn`` could not send ``msg.copies`` to ``msg.receiver``: each copy that
        a run in flight takes from it there is poisoned at the receiver, which fails the
        run there now (a lost receiver's own loss fails it anyway). A claim for a copy of no
        such run changes nothing: a worker cannot poison copies other senders owe."""
        receiver = self.workers.get(msg.receiver)
        claimed = set(msg.copies)
        owed = {d.tbase + copy - d.nvalues for run in self.scheduler.in_flight() for d in run.payload.parts
                for sender, to, copy in d.lowered.transfers if sender == conn.worker and to == msg.receiver}
        if receiver is not None and claimed & owed:
            receiver.outbox.put(m.Poisoned(tuple(sorted(claimed & owed)), REMOTE, msg.message))

    def check_stuck_runs(self) -> None:
        """Reset every island that has had runs in flight and finished none of them for
        longer than the run timeout (the shell calls this every so often): its oldest run
        fails with DeadlineExceededError naming the hosts that had not finished it."""
        if self.run_timeout is None:
            return
        for island, run in list(self.dispatcher.stalled(self.run_timeout)):
            if self.scheduler.running(run.id) is run:  # not cut already by an earlier reset of this call
                self._reset_stuck(island, run)

    def _reset_stuck(self, island: int, run: ScheduledRun) -> None:
        """Island ``island`` stalled on ``run``: the run fails with DeadlineExceededError,
        and the island is reset as if it had lost a host (everything on it fails with
        WorkerLostError), its hosts told to restart (those that had not finished the run
        first write their threads' stacks to their logs) and join it again."""
        name = self.islands.by_id[island].describe()
        waiting = run.payload.waiting
        behind = [w for w in sorted(waiting) if w in self.workers]
        hosts = ", ".join(_stuck_host(self.workers[w]) for w in behind) or "no host it was sent to"
        why = (f"run {run.id} did not finish within the run timeout of {self.run_timeout:g} s: {hosts} had not "
               "finished it (stuck in a computation, or in a collective waiting for a host that is; the threads' "
               "stacks of each are in its log)")
        log.warning("island %s is stuck and is reset: %s", name, why)
        workers = self.membership.lose_island(island, f"it was reset: {why}")
        message = (f"island {name} was reset because {why}; arrays and computations on it are gone. Its hosts "
                   "restart and join it again, and its slices and compiled functions then work again")
        self._cut(workers, message, {run.id: (STUCK, f"{why}. Island {name} was reset: its hosts restart, and "
                                                      "its slices work again once they have joined it")})
        for w in workers:
            conn = self.membership.remove(w)
            if conn is not None:
                conn.outbox.put(m.Reset(message, stacks=w in waiting))
        self._after_loss(workers, message)
        self._forget_old_losses()

    def _cut(self, lost: set[int], message: str, failures: dict[int, tuple[str, str]] | None = None) -> None:
        """Workers ``lost`` go away: every run, array and compile that involves them fails
        with WorkerLostError saying ``message`` (a run in ``failures``, by id: with that
        kind and message instead); copies they were sending to other workers reach them
        poisoned."""
        failures = failures or {}
        queued, flying = self.scheduler.cancel(lambda r: bool(r.payload.lowered.workers & lost))
        self.dispatcher.progressed(flying)
        for run in flying:
            self.dispatcher.release_all(run, lost)
            # each copy once per receiver, however many of its senders were lost
            stranded: dict[int, dict[int, None]] = {}
            for d in run.payload.parts:
                for sender, receiver, copy in d.lowered.transfers:
                    if sender in lost and receiver not in lost and receiver in self.workers:
                        stranded.setdefault(receiver, {})[d.tbase + copy - d.nvalues] = None
            for receiver, copies in stranded.items():
                self.workers[receiver].outbox.put(m.Poisoned(tuple(copies), LOST, message))
        for run in (*queued, *flying):
            self._poison(run.session, (h for d in run.payload.parts for h in d.outputs.values()),
                         *failures.get(run.id, (LOST, message)))
        for run in queued:
            self._reads_done(run)
        for sid, s in self.sessions.items():  # each array that failed already keeps its first cause
            self._poison(sid, (h for h in s.handles.on_workers(lost) if h not in s.handles.poisoned), LOST, message)
            for fn in [fn for fn, c in s.programs.compiling.items() if set(c.workers) & lost]:
                del s.programs.compiling[fn]
                s.programs.failed[fn] = message
                s.outbox.put(m.Compiled(fn, message, kind=LOST))

    def _after_loss(self, lost: set[int], message: str) -> None:
        """Once workers ``lost`` are removed: runs they held back may go, suspends and
        resumes stop waiting for them, and a retirement may be drained."""
        self._pump()
        for sid, s in list(self.sessions.items()):
            if s.suspension is not None:
                self._suspension_lost(sid, s, lost, message)
        self._check_retiring()

    def _healed(self, island: int) -> None:
        """Every host of a lost island has joined again, as new processes under the worker
        ids of the ranks they took: each session's slices there are valid again, at new
        addresses (SliceMoved), and its functions there compile again on the new hosts."""
        self.islands.healed(island)
        hosts = {w for w, c in self.workers.items() if c.island == island}
        log.info("island %s healed: worker(s) %s joined it again",
                 self.islands.by_id[island].describe(), sorted(hosts))
        for s in self.sessions.values():
            for slice_id in sorted(s.slices):
                p = self.rm.slices.get(slice_id)
                if p is not None and p.island == island:
                    self._moved(s, m.SliceMoved(slice_id, p.workers,
                                                tuple(self.workers[w].address for w in p.workers), island,
                                                m.flat_devices(p.devices)))
            for fn, compile_msg in s.programs.compiles.items():
                if set(compile_msg.workers) <= hosts:
                    for w in compile_msg.workers:
                        self.workers[w].outbox.put(compile_msg)

    def measure(self, done: Callable[[], None]) -> int:
        return self.membership.measure(done)

    def abandon_measurement(self, mid: int) -> list[int]:
        return self.membership.abandon_measurement(mid)

    # ---- retiring islands and hosts (`pathways retire`) ------------------------------------

    def retire(self, island: str, worker: int | None, done: Callable[[], None]) -> Retirement:
        """Begin retiring island ``island`` (its name, or its id where no island has that
        name) or, given ``worker``, that one host: from now on its island takes no new slices,
        and ``done()`` is called once no run is queued or in flight there (at once when none
        is, as on a lost island). The shell then calls ``finish_retirement``, when done()
        came or its wait ran out, or ``abandon_retirement`` when the operator gave up.
        Raises PathwaysError saying what is wrong: no such island or worker, or it is
        being retired already."""
        islands = self.islands
        conn = None
        if worker is not None:
            conn = self.workers.get(worker)
            if conn is None:
                raise PathwaysError(f"no worker {worker} is attached; `python -m pathways status` lists the workers "
                                    "(retire a lost island by its name)")
            target = islands.by_id[conn.island]
        else:
            target = islands.find(island)
            if target is None and island.isdecimal():
                target = islands.by_id.get(int(island))
            if target is None:
                known = ", ".join(repr(i.name) for i in islands.by_id.values()) or "none"
                raise PathwaysError(f"no island is named {island!r} (the islands: {known}); "
                                    "`python -m pathways status` lists them")
        if target.retiring:
            raise PathwaysError(f"island {target.describe()} is being retired already: another retire request is "
                                "draining it")
        whole = conn is None or target.hosts == 1  # the only host of its island takes the island with it
        r = Retirement(next(self._retirement_ids), target, None if whole else conn, done)
        self._retirements[r.id] = r
        self.islands.set_retiring(target.id, True)
        log.info("retiring %s: it takes no new slices; waiting for its %d queued and %d in-flight run(s)",
                 r.describe(), self.scheduler.queued(target.id), self.scheduler.inflight(target.id))
        self._check_retiring()
        return r

    def finish_retirement(self, r: Retirement) -> dict[str, Any]:
        """Retire what ``r`` names, whether its runs drained or not: the hosts are told to
        shut down (Shutdown: they exit, their keepers do not start them again), whatever
        still involves them fails with WorkerLostError saying the operator retired them,
        and, for a whole island, its slices are released and the island forgotten (its
        name is free for new workers). One host of a larger island is lost on purpose: the
        island heals once a host replaces it. Returns what was done, for the operator."""
        if self._retirements.pop(r.id, None) is None:
            return {}
        island = r.island
        report: dict[str, Any] = {"island": island.name, "id": island.id, "worker": None, "hosts": [],
                                  "runs_cut": self.scheduler.queued(island.id) + self.scheduler.inflight(island.id),
                                  "slices_released": 0, "sessions": [], "was": island.health.value}
        if self.islands.by_id.get(island.id) is not island:  # forgotten meanwhile, as a lost island
            report["was"] = "forgotten"
            return report
        self.islands.set_retiring(island.id, False)
        if r.host is not None:
            conn = r.host
            report["worker"] = conn.worker
            if self.workers.get(conn.worker) is not conn:
                report["was"] = "lost"  # it went away while its island drained: nothing left to shut down
                return report
            report["hosts"] = [conn.worker]
            report["sessions"] = self._owners(island.id)
            conn.outbox.put(m.Shutdown(f"this host was retired by the operator (`pathways retire --worker "
                                       f"{conn.worker}`)"))
            self._lose_host(conn, f"it was retired by the operator (`pathways retire --worker {conn.worker}`)")
            return report
        name = island.describe()
        message = (f"island {name} was retired by the operator (`pathways retire`): "
                   + ("it had lost a host, and is forgotten" if island.health is Health.LOST else "its hosts were shut down")
                   + "; its arrays and computations are gone and its slices released. Ask for a slice on "
                     "another island (`python -m pathways status` lists them)")
        hosts = {w for w, c in self.workers.items() if c.island == island.id}
        report["hosts"] = sorted(hosts)
        report["sessions"] = self._owners(island.id)
        self._cut(hosts, message)
        for w in sorted(hosts):
            self.membership.remove(w).outbox.put(m.Shutdown(message))
        report["slices_released"] = self._forget_island(island.id, message)
        log.warning("island %s (%s) retired by the operator: %d host(s) shut down, %d run(s) cut, %d slice(s) "
                    "released", name, report["was"], len(hosts), report["runs_cut"], report["slices_released"])
        self._after_loss(hosts, message)
        return report

    def abandon_retirement(self, r: Retirement) -> None:
        """The operator gave up waiting: the island takes slices again."""
        if self._retirements.pop(r.id, None) is not None:
            if self.islands.by_id.get(r.island.id) is r.island:
                self.islands.set_retiring(r.island.id, False)
            log.info("retiring %s abandoned: it takes slices again", r.describe())

    def _check_retiring(self) -> None:
        """Tell retirements whose island has no run queued or in flight any more."""
        for r in list(self._retirements.values()):
            i = r.island.id
            if not r.drained and not self.scheduler.queued(i) and not self.scheduler.inflight(i):
                r.drained = True
                r.done()

    def _owners(self, island: int) -> list[int]:
        """The sessions with a slice on ``island``."""
        return sorted({p.owner for p in self.rm.slices.values() if p.island == island and p.owner in self.sessions})

    def _forget_island(self, island: int, message: str) -> int:
        """Forget an island whose workers are removed: release its slices (their sessions
        are told ``message`` when they use them, as when they run a function or put an
        array on its former hosts), and free its name. Returns the slices released."""
        isl = self.islands.by_id[island]
        placements = self.rm.forget_island(island)
        former = {*isl.members.values(), *isl.former.values(), *(w for p in placements for w in p.workers)}
        for w in former:
            self._gone_why[w] = message
        while len(self._gone_why) > MAX_WORKERS:  # bounded: only the latest retirements need explaining
            del self._gone_why[next(iter(self._gone_why))]
        for p in placements:
            s = self.sessions.get(p.owner)
            if s is not None and p.slice_id in s.slices:
                s.slices.discard(p.slice_id)
                s.released[p.slice_id] = message
        self.islands.forget(island)
        return len(placements)

    def _forget_old_losses(self) -> None:
        """Keep at most MAX_LOST_ISLANDS lost islands that no host has rejoined: forget the
        oldest losses beyond it, so that hosts that come and go for good (one-host islands
        of their own, say) do not pile up in status."""
        for i in self.islands.long_lost(MAX_LOST_ISLANDS):
            island = self.islands.by_id[i]
            name = island.describe()
            message = (f"island {name} was lost ({island.lost_by}) and is forgotten: the controller remembers at "
                       f"most {MAX_LOST_ISLANDS} lost islands that no host has rejoined, and this was the oldest; "
                       "its slices were released. Ask for a slice on a healthy island")
            log.warning("forgetting island %s, lost the longest (at most %d lost islands are kept)", name,
                        MAX_LOST_ISLANDS)
            self._forget_island(i, message)

    def _why_gone(self, workers: Iterable[int]) -> str | None:
        """Why one of ``workers`` is gone for good, where an island was retired or forgotten."""
        return next((self._gone_why[w] for w in workers if w in self._gone_why), None)

    # ---- sessions --------------------------------------------------------------------

    def session_opened(self, sid: int, outbox: MessageSink) -> None:
        """A client connected as session ``sid`` (ids increase): draw its credential and
        tell every worker its digest before the client learns it in the welcome, so that
        its puts seldom wait for it (they travel on other connections, so they still may)."""
        self.sessions[sid] = SessionState(outbox, secrets.token_bytes(m.CREDENTIAL_BYTES))
        self.scheduler.add_session(sid)
        for w in self.workers.values():
            w.outbox.put(self._session_open(sid, w))

    def _session_open(self, sid: int, worker: WorkerConn) -> m.SessionOpen:
        """What ``worker`` is told of session ``sid``: the digest of the credential the
        session presents to it, and to no other worker."""
        return m.SessionOpen(sid, m.digest(m.worker_credential(self.sessions[sid].credential, worker.address)))

    def session_closed(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is None:
            return
        self.scheduler.remove_session(sid)
        self.rm.release_owner(sid)
        drop = m.DropSession(sid, tuple(s.programs.keys))
        for w in self.workers.values():
            w.outbox.put(drop)
            w.defined.difference_update(drop.programs)
        log.info("session %d closed: freed %d array(s) and %d slice(s)", sid, len(s.handles.live), len(s.slices))
        if self._retirements:  # its queued runs are gone
            self._check_retiring()

    def on_session_batch(self, sid: int, payload: bytes) -> None:
        s = self.sessions.get(sid)
        if s is None:
            return
        try:
            batch = m.SESSION_UP.decode_batch(payload)
        except WireError as e:
            s.outbox.put(m.Error(None, kind_of(e), clip_text(f"controller dropped a batch: {e}")))
            return
        for msg in batch:
            self.on_session_message(sid, msg)

    def on_session_message(self, sid: int, msg: Union[m.Message, m.Malformed]) -> None:
        s = self.sessions.get(sid)
        if s is None:
            return
        if type(msg) is m.Malformed:
            s.outbox.put(m.Error(msg.req, kind_of(msg.error), clip_text(f"{msg.tag}: {msg.error}")))
            return
        try:
            self._handlers[type(msg)](self, sid, s, msg)
        except PathwaysError as e:
            s.outbox.put(m.Error(getattr(msg, "req", None), kind_of(e), clip_text(f"{msg.TAG}: {e}")))

    @staticmethod
    def _own(sid: int, ident: int, what: str) -> int:
        if session_of(ident) != sid:
            raise AccessDeniedError(f"{what} {ident:#x} does not belong to this session (it is numbered in "
                                    f"session {session_of(ident)}'s range): a client names only the arrays, "
                                    "functions and programs it created itself")
        return ident

    def _hello(self, sid: int, s: SessionState, msg: m.Hello) -> None:
        if msg.version != m.PROTOCOL_VERSION:
            raise WireError(f"client speaks protocol {msg.version}, controller speaks "
                            f"{m.PROTOCOL_VERSION}; install the same pathways version on both")
        self.scheduler.set_weight(sid, msg.weight)
        s.outbox.put(m.SessionWelcome(sid, s.credential))

    def _cluster(self, sid: int, s: SessionState, msg: m.ClusterRequest) -> None:
        s.outbox.put(m.ClusterReply(msg.req, self.status()))

    def _slice(self, sid: int, s: SessionState, msg: m.SliceRequest) -> None:
        self._refuse_if_suspended(s, "ask for a slice")
        p = self.rm.place(msg.count, msg.kind, msg.mesh_shape, msg.island, msg.exclusive, owner=sid)
        s.slices.add(p.slice_id)
        s.outbox.put(m.SliceReply(msg.req, p.slice_id, p.workers, tuple(self.workers[w].address for w in p.workers),
                                  p.island, m.flat_devices(p.devices), p.mesh_shape))

    def _fn(self, sid: int, s: SessionState, msg: m.DefineFunction) -> None:
        fn = self._own(sid, msg.id, "function")
        self._refuse_if_suspended(s, "define a function")
        s.programs.slice_of[fn] = msg.slice
        # a redefinition replaces the function, whatever its state
        s.programs.fns.pop(fn, None)
        s.programs.compiling.pop(fn, None)
        s.programs.failed.pop(fn, None)
        s.programs.compiles.pop(fn, None)
        body = msg.body
        if body.format == "xla":
            try:
                self._xla_fn(fn, s, msg)
            except PathwaysError as e:  # the client waits for the Compiled reply, not for an Error
                s.programs.failed[fn] = str(e)
                s.outbox.put(m.Compiled(fn, f"{msg.TAG}: {e}", kind=kind_of(e)))
            return
        placement = self._placement(s, msg)
        rank_of = self._ranks(placement)
        slice_devices = set(placement.devices)
        for layout in (*body.ins, *body.outs):
            if not set(layout.devices) <= slice_devices:
                raise WireError(f"function {body.name!r} names devices outside its slice: "
                                f"{sorted(set(layout.devices) - slice_devices)}")
            hosts = tuple(w for w in placement.workers if rank_of[w] in {r for r, _ in layout.devices})
            if layout.workers != hosts:
                raise WireError(f"function {body.name!r} has a layout on workers {list(layout.workers)}, but its "
                                f"devices are on workers {list(hosts)}")
        ranks = {r for layout in (*body.ins, *body.outs) for r, _ in layout.devices}
        # a function of no arrays at all runs on the whole slice
        workers = tuple(w for w in placement.workers if rank_of[w] in ranks) or placement.workers
        s.programs.fns[fn] = FnLayouts(workers, body.ins, body.outs)
        compile_msg = s.programs.compiles[fn] = m.Compile(fn, body, workers)
        self._send_compile(placement, compile_msg)

    def _xla_fn(self, fn: int, s: SessionState, msg: m.DefineFunction) -> None:
        """Have the hosts of an "xla" function's devices compile it; the host of its first
        device answers with Compiled (``_compiled``)."""
        placement = self._placement(s, msg)
        body = msg.body
        devices = m.device_pairs(body.devices)
        outside = [d for d in devices if d not in set(placement.devices)]
        if outside:
            raise WireError(f"function {body.name!r} names devices {outside} (host rank, index) outside slice "
                            f"{msg.slice}, whose devices are {list(placement.devices)}")
        rank_of = self._ranks(placement)
        ranks = {r for r, _ in devices}
        workers = tuple(w for w in placement.workers if rank_of[w] in ranks)
        reporter = next(w for w in workers if rank_of[w] == devices[0][0])
        s.programs.compiling[fn] = XlaCompile(body.name, workers, reporter, devices)
        compile_msg = s.programs.compiles[fn] = m.Compile(fn, body, workers)
        self._send_compile(placement, compile_msg)

    def _send_compile(self, placement: SlicePlacement, compile_msg: m.Compile) -> None:
        """Have the hosts compile a function now, or, on an island that is healing, once it
        has healed (``_healed`` sends every session's compiles to the island's new hosts)."""
        if self.islands.healthy(placement.island):
            for w in compile_msg.workers:
                self.workers[w].outbox.put(compile_msg)

    def _placement(self, s: SessionState, msg: m.DefineFunction) -> SlicePlacement:
        placement = self.rm.slices.get(msg.slice)
        if msg.slice in s.released:
            raise PlacementError(f"slice {msg.slice} is gone: {s.released[msg.slice]}")
        if placement is None or msg.slice not in s.slices:
            raise WireError(f"slice {msg.slice} is not one of this session's slices")
        gone = self.membership.gone(placement.workers)
        if gone and not self._heals(placement.island):
            raise WorkerLostError(f"slice {msg.slice} lost its worker(s) {gone}: {self.membership.healing(gone)}. "
                                  "Define the function again once `python -m pathways status` shows the island "
                                  "healthy, or ask for a slice on a healthy island")
        return placement

    def _heals(self, island_id: int) -> bool:
        """Whether the island lost hosts and may get them back (restarted, or started by
        hand even where nothing restarts them): a function defined there meanwhile compiles
        once it has healed, and only its runs fail until then (what an elastic loop's health
        check needs: its compile waits for the island instead of failing at once)."""
        island = self.islands.by_id.get(island_id)
        return island is not None and island.recovering

    def _ranks(self, placement: SlicePlacement) -> dict[int, int]:
        """Each worker of the slice's island rank (a lost host's: the rank it held)."""
        island = self.islands.by_id[placement.island]
        held = {w: r for r, w in (*island.former.items(), *island.members.items())}
        return {w: self.rm.hosts[w].rank if w in self.rm.hosts else held[w] for w in placement.workers}

    def _compiled(self, conn: WorkerConn, msg: m.Compiled) -> None:
        """An "xla" function compiled (or not): record where it runs, tell its session."""
        sid = session_of(msg.fn)
        s = self.sessions.get(sid)
        pending = s.programs.compiling.get(msg.fn) if s is not None else None
        if pending is None:
            # its session left, or redefined it: a late report, harmless
            log.info("worker %s reported function %#x compiled, which no session waits for", conn.worker, msg.fn)
            return
        if conn.worker != pending.reporter:
            conn.outbox.put(m.Notice(f"controller ignored Compiled for function {msg.fn:#x}: worker "
                                     f"{pending.reporter} reports it, not worker {conn.worker}"))
            return
        if not msg.error:
            wrong = next((x for x in (*msg.ins, *msg.outs)
                          if not set(x.workers) <= set(pending.workers) or not set(x.devices) <= set(pending.devices)),
                         None)
            if wrong is not None:
                msg = m.Compiled(msg.fn, f"the executable of {pending.name!r} reported a layout on workers "
                                         f"{list(wrong.workers)}, devices {list(wrong.devices)}, outside its own")
        del s.programs.compiling[msg.fn]
        if msg.error:
            s.programs.failed[msg.fn] = msg.error
        else:
            s.programs.fns[msg.fn] = FnLayouts(pending.workers, msg.ins, msg.outs)
        s.outbox.put(msg)

    def _program(self, sid: int, s: SessionState, msg: m.DefineProgram) -> None:
        s.programs.define(self._own(sid, msg.id, "program"), msg.graph, msg.dispatch == "sequential")

    @staticmethod
    def _moved(s: SessionState, msg: m.SliceMoved) -> None:
        """Tell a session its slice moved, and remember to which hosts (see ``_put``)."""
        s.moved.append(frozenset(msg.workers))
        s.outbox.put(msg)

    def _put(self, sid: int, s: SessionState, msg: m.PutNotice) -> None:
        handle = self._own(sid, msg.handle, "handle")
        replaced = set(msg.layout.workers) & frozenset().union(*s.moved[msg.moves:])
        if replaced:
            # the client sent the bytes to where these hosts were before: nothing will arrive
            self._poison(sid, [handle], LOST, f"the array was sent to worker(s) {sorted(replaced)} at addresses "
                                              "they had before their island healed (or the session resumed), so it "
                                              "never arrived; put it again")
            return
        if s.suspension is not None:
            self._poison(sid, [handle], SUSPENDED_KIND, _suspended_message("put an array"))
            return
        gone = self.membership.gone(msg.layout.workers)
        if gone:
            why = self._why_gone(gone) or (
                f"{self.membership.healing(gone)}. The array is lost (its bytes went to hosts that left); once "
                "the island has healed (`python -m pathways status` shows it healthy) its slices work again, and "
                "putting it again, or calling again, works")
            self._poison(sid, [handle], LOST, f"the array was put on worker(s) {gone}, which are gone: {why}")
            return
        s.handles.live[handle] = msg.layout

    def _delete(self, sid: int, s: SessionState, msg: m.Delete) -> None:
        foreign = [h for h in msg.handles if session_of(h) != sid]
        if foreign:
            raise AccessDeniedError(f"{len(foreign)} of the {len(msg.handles)} array(s) to delete belong to other "
                                    f"sessions (the first: {foreign[0]:#x}, session {session_of(foreign[0])}'s); "
                                    "a client deletes only its own arrays, so none was deleted")
        self._send_deletes(s.handles.delete(msg.handles))

    def _run(self, sid: int, s: SessionState, msg: m.Run) -> None:
        graph = s.programs.graphs.get(msg.program)
        if graph is None:
            raise WireError(f"program {msg.program} was never registered by this session")
        base = self._own(sid, msg.base, "handle base")
        if not fits(base, graph.nvalues):
            raise WireError("handle base leaves no room for the program's values")
        args = msg.inputs
        if set(args) != set(graph.inputs):
            raise WireError(f"run binds inputs {sorted(args)}; the program has {sorted(graph.inputs)}")
        outputs = {v: args.get(v, base + v) for v in graph.outputs}
        foreign = next(((v, h) for v, h in sorted(args.items()) if session_of(h) != sid), None)
        if foreign is not None:
            # the outputs are the reply: the client waits on them, not on this message
            v, h = foreign
            self._poison(sid, (out for w, out in outputs.items() if w not in args), DENIED,
                         f"the run binds array {h:#x}, which belongs to session {session_of(h)}, as input {v} of "
                         f"program {msg.program:#x}: a program reads only arrays its own client created")
            return
        if s.suspension is not None:
            self._poison(sid, (out for w, out in outputs.items() if w not in args), SUSPENDED_KIND,
                         _suspended_message("run a program"))
            return
        if msg.traced:
            began = now()
        try:
            key, lowered = s.programs.lowered(msg.program, args, s.handles, self.membership.unavailable,
                                              self.membership.healing)
        except RunFailure as e:
            self._poison(sid, outputs.values(), e.kind, self._run_failure(s, graph, e))
            return
        tbase = self._next_copy
        self._next_copy += lowered.ncopies
        fresh = {v: h for v, h in outputs.items() if v not in args}
        for v, h in fresh.items():
            s.handles.live[h] = lowered.output_layouts[v]
        s.handles.reads_queued(args.values())
        d = Dispatch(key, lowered, graph.nvalues, base, tbase, args, fresh, traced=msg.traced)
        if msg.traced:
            RECORDER.span("lower", began, base)
            s.traced_workers.update(lowered.workers)
            began = now()
        if coalesce(self.scheduler, s.tail, d):
            if msg.traced:
                RECORDER.span("schedule", began, base, "joined the queued run before it")
                d.since = now()
            return  # it goes out with the queued run before it, when that is released
        islands = frozenset(self.workers[w].island for w in lowered.workers)
        s.tail = self.scheduler.submit(ScheduledRun(sid, islands, key, d))
        if msg.traced:
            RECORDER.span("schedule", began, base)
            d.since = now()
        self._pump()

    def _run_failure(self, s: SessionState, graph: ProgramGraph, e: RunFailure) -> str:
        """Why a run failed: where its functions live on hosts gone for good (their island
        was retired or forgotten), that, rather than advice to wait for the island to heal."""
        if e.kind != LOST or not self._gone_why:
            return str(e)
        fns = s.programs.fns
        gone = sorted({w for node in graph.nodes if node.fn in fns for w in fns[node.fn].workers
                       if w in self._gone_why})
        return f"{self._gone_why[gone[0]]} (the run needs worker(s) {gone})" if gone else str(e)

    def _timeline(self, sid: int, s: SessionState, msg: m.CollectTimeline) -> None:
        events, dropped = RECORDER.take(sid, msg.max_events)
        addresses = tuple(self.workers[w].address for w in sorted(s.traced_workers) if w in self.workers)
        # the traced runs whose steps here are not all recorded yet: their workers' done
        # reports may reach the controller after the client's request
        unfinished = sum(1 for run in self.scheduler.runs_of(sid) if any(p.traced for p in run.payload.parts))
        s.outbox.put(m.Timeline(msg.req, now(), os.getpid(), dropped, tuple(events), addresses, unfinished))

    # ---- suspend and resume (suspension.py) ---------------------------------------------

    @staticmethod
    def _refuse_if_suspended(s: SessionState, what: str) -> None:
        if s.suspension is not None:
            raise SuspendedError(_suspended_message(what))

    def _suspend(self, sid: int, s: SessionState, msg: m.Suspend) -> None:
        if s.suspension is not None:
            raise SuspendedError(f"the session is already {s.suspension.state}; call resume() before suspending "
                                 "it again")
        partial = sorted(h for h, layout in s.handles.live.items() if layout.unreduced)
        if partial:
            # offloading keeps one copy of each block, and an unreduced array's devices hold
            # different partial values of theirs
            raise SuspendedError(f"the session holds unreduced arrays {[hex(h) for h in partial[:8]]}, whose devices "
                                 "hold partial values that suspending would not keep; reduce them "
                                 "(jax.sharding.reshard) or delete them, then suspend")
        s.suspension = Suspension(msg.req, msg.path)
        s.tail = None
        self._draining.add(sid)
        self._drained()

    def _drained(self) -> None:
        """Suspending sessions whose runs have all finished move their arrays off the devices."""
        for sid in list(self._draining):
            s = self.sessions.get(sid)
            stats = self.scheduler.session_stats(sid)
            if s is None or s.suspension is None:
                self._draining.discard(sid)
            elif not stats.get("queued") and not stats.get("inflight"):
                self._draining.discard(sid)
                self._offload(sid, s)

    def _offload(self, sid: int, s: SessionState) -> None:
        sus = s.suspension
        sus.state = OFFLOADING
        holders = {w for layout in s.handles.live.values() for w in layout.workers}
        holders.update(w for slice_id in s.slices if slice_id in self.rm.slices
                       for w in self.rm.slices[slice_id].workers)
        sus.waiting = {w for w in holders if w in self.workers}
        for w in sus.waiting:
            self.workers[w].outbox.put(m.Offload(sid, sus.path))
        self._offload_step(sid, s)

    def _offloaded(self, conn: WorkerConn, msg: m.Offloaded) -> None:
        s = self.sessions.get(msg.session)
        sus = s.suspension if s is not None else None
        if sus is None or sus.state != OFFLOADING or conn.worker not in sus.waiting:
            log.info("worker %s reported arrays of session %d offloaded, which no suspend waits for",
                     conn.worker, msg.session)
            return
        sus.waiting.discard(conn.worker)
        sus.holders.add(conn.worker)
        sus.shapes.update(msg.arrays)
        sus.arrays += len(msg.arrays)
        sus.nbytes += msg.nbytes
        if msg.warning:
            sus.warnings.append(msg.warning)
        for handle, kind, message in msg.failed:
            if handle in s.handles.live and handle not in s.handles.poisoned:
                self._poison(msg.session, [handle], kind, message)
        self._offload_step(msg.session, s)

    def _offload_step(self, sid: int, s: SessionState) -> None:
        """Once every holder has offloaded: release the slices, and answer the Suspend."""
        sus = s.suspension
        if sus.waiting:
            return
        for slice_id in sorted(s.slices):
            placement = self.rm.slices.get(slice_id)
            if placement is not None:
                sus.placements[slice_id] = placement
                self.rm.release(slice_id)
        sus.state = SUSPENDED
        log.info("session %d suspended: %d array(s), %d bytes off the devices; %d slice(s) released", sid,
                 sus.arrays, sus.nbytes, len(sus.placements))
        s.outbox.put(m.Suspended(sus.req, sus.arrays, sus.nbytes, "; ".join(sus.warnings)[:m.MAX_TEXT // 2]))

    def _resume(self, sid: int, s: SessionState, msg: m.Resume) -> None:
        sus = s.suspension
        if sus is None or sus.state != SUSPENDED:
            raise SuspendedError("the session is not suspended; call resume() only after suspend() returned"
                                 if sus is None else f"the session is {sus.state}; wait for it to finish")
        remap = self._replace(sid, sus)
        sus.req, sus.state = msg.req, RESUMING
        for slice_id, new in sorted(remap.slices.items()):
            self._moved(s, m.SliceMoved(slice_id, new.workers, tuple(self.workers[w].address for w in new.workers),
                                        new.island, m.flat_devices(new.devices)))
        self._remap_functions(s, remap)
        self._move_arrays(sid, s, remap)

    def _replace(self, sid: int, sus: Suspension) -> Remap:
        """Place the suspended slices again; slices that had the same devices share new ones."""
        moves: list = []
        done: dict[tuple, object] = {}
        try:
            for slice_id, old in sorted(sus.placements.items()):
                twin = done.get((old.workers, old.devices))
                if twin is not None and not old.exclusive:
                    new = self.rm.place_with(twin, slice_id)
                else:
                    new = self.rm.place(len(old.devices), old.kind, old.mesh_shape, None, old.exclusive, owner=sid,
                                        slice_id=slice_id)
                done.setdefault((old.workers, old.devices), new)
                moves.append((old, new))
        except PlacementError as e:
            for _, new in moves:
                self.rm.release(new.slice_id)
            raise PlacementError(f"cannot resume: {e}. The session stays suspended: free devices (another "
                                 "session's exclusive slice, say) and call resume() again") from None
        return Remap(moves, {w: self.rm.hosts[w].rank for _, new in moves for w in new.workers})

    def _remap_functions(self, s: SessionState, remap: Remap) -> None:
        """Functions follow their slices: new layouts, compiled again on the new hosts."""
        progs = s.programs
        for fn, compile_msg in list(progs.compiles.items()):
            slice_id = progs.slice_of.get(fn)
            if slice_id not in remap.slices:
                continue
            moved = progs.compiles[fn] = remap.compile(compile_msg, slice_id)
            if fn in progs.fns:
                progs.fns[fn] = remap.function(progs.fns[fn], slice_id)
            pending = progs.compiling.get(fn)
            if pending is not None:
                devices = m.device_pairs(moved.body.devices)
                rank = {w: self.rm.hosts[w].rank for w in moved.workers}
                progs.compiling[fn] = XlaCompile(pending.name, moved.workers,
                                                 next(w for w in moved.workers if rank[w] == devices[0][0]), devices)
            for w in moved.workers:
                self.workers[w].outbox.put(moved)
        progs.forget_lowerings()

    def _move_arrays(self, sid: int, s: SessionState, remap: Remap) -> None:
        """Plan each live array's move from the hosts that offloaded it to its new layout:
        Restore to every old holder, Adopt to every receiver."""
        sus = s.suspension
        restores: dict[int, list] = {w: [] for w in sus.holders if w in self.workers}
        adopts: dict[int, list] = {}
        lost: list[int] = []
        stray: list[int] = []
        for handle, layout in list(s.handles.live.items()):
            new = remap.layout(layout)
            if new is None:
                if handle not in s.handles.poisoned:
                    stray.append(handle)
                continue
            s.handles.live[handle] = new
            if handle in s.handles.poisoned:
                continue
            shape = sus.shapes.get(handle)
            if shape is None or self.membership.gone(layout.workers):
                lost.append(handle)
                continue
            copy = self._next_copy
            self._next_copy += 1
            routes = plan(shape, layout, new)
            senders: dict[int, int] = {}
            for route in routes:
                senders[route.receiver] = senders.get(route.receiver, 0) + 1
            by_sender: dict[int, list] = {}
            for route in routes:
                by_sender.setdefault(route.sender, []).append(
                    (route.receiver, senders[route.receiver], route.regions))
            for sender, sends in by_sender.items():
                restores.setdefault(sender, []).append((handle, copy, new, tuple(sends)))
            for receiver in senders:
                adopts.setdefault(receiver, []).append(
                    (copy, handle, tuple(route.sender for route in routes if route.receiver == receiver)))
            sus.moving[handle] = (copy, tuple(by_sender), tuple(senders))
        if lost:
            self._poison(sid, lost, REMOTE, "the array was not on its workers when the session was suspended (its "
                                            "put or computation never completed there), so it could not be resumed")
        self._poison(sid, stray, REMOTE, "the array lay on devices of no slice of the session, so it had nowhere to "
                                         "go when the session resumed")
        for w, moves in restores.items():
            self.workers[w].outbox.put(m.Restore(sid, tuple(moves)))
        sus.waiting = set(adopts)
        for w, arrivals in adopts.items():
            self.workers[w].outbox.put(m.Adopt(sid, tuple(arrivals)))
        self._resume_step(sid, s)

    def _adopted(self, conn: WorkerConn, msg: m.Adopted) -> None:
        s = self.sessions.get(msg.session)
        sus = s.suspension if s is not None else None
        if sus is None or sus.state != RESUMING or conn.worker not in sus.waiting:
            return
        sus.waiting.discard(conn.worker)
        if msg.late:
            log.warning("worker %s: %d array(s) of session %d did not arrive in time to resume", conn.worker,
                        msg.late, msg.session)
        self._resume_step(msg.session, s)

    def _resume_step(self, sid: int, s: SessionState) -> None:
        sus = s.suspension
        if sus.waiting:
            return
        s.suspension = None
        log.info("session %d resumed: %d array(s) moved onto %d slice(s)", sid, len(sus.moving), len(sus.placements))
        s.outbox.put(m.Resumed(sus.req, len(sus.moving)))

    def _suspension_lost(self, sid: int, s: SessionState, lost: set[int], message: str) -> None:
        """Workers were lost while the session suspends or resumes: wait no longer for
        them; arrays they were sending reach their receivers poisoned."""
        sus = s.suspension
        sus.holders -= lost
        gone = sus.waiting & lost
        sus.waiting -= lost
        if sus.state == RESUMING:
            doomed = []
            for handle, (copy, senders, receivers) in sus.moving.items():
                if lost & set(senders):
                    doomed.append(handle)
                    for r in receivers:
                        if r not in lost and r in self.workers:
                            self.workers[r].outbox.put(m.Poisoned((copy,), LOST, message))
            self._poison(sid, [h for h in doomed if h not in s.handles.poisoned], LOST, message)
            if gone:
                self._resume_step(sid, s)
        elif sus.state == OFFLOADING and gone:
            self._offload_step(sid, s)
        elif sus.state == DRAINING:
            self._drained()

    _handlers: dict[type, Callable] = {
        m.Hello: _hello, m.ClusterRequest: _cluster, m.SliceRequest: _slice, m.DefineFunction: _fn,
        m.DefineProgram: _program, m.PutNotice: _put, m.Delete: _delete, m.Run: _run,
        m.CollectTimeline: _timeline, m.Suspend: _suspend, m.Resume: _resume,
    }

    # ---- shared ----------------------------------------------------------------------

    def _pump(self) -> None:
        for run in self.dispatcher.release():
            self._reads_done(run)

    def _reads_done(self, run: ScheduledRun) -> None:
        """A run left the queue (dispatched or dropped): deletes it held back can go now."""
        s = self.sessions.get(run.session)
        if s is not None:
            for d in run.payload.parts:
                self._send_deletes(s.handles.reads_done(d.args.values()))

    def _send_deletes(self, doomed: dict[int, Layout]) -> None:
        by_worker: dict[int, list[int]] = {}
        for h, layout in doomed.items():
            for w in layout.workers:
                by_worker.setdefault(w, []).append(h)
        for worker, handles in by_worker.items():
            if worker in self.workers:
                self.workers[worker].outbox.put(m.Delete(tuple(handles)))

    def _poison(self, sid: int, handles: Iterable[int], kind: str, message: str) -> None:
        s = self.sessions.get(sid)
        handles = tuple(handles)
        if s is None or not handles:
            return
        s.handles.poison(handles, kind, message)
        s.outbox.put(m.Poisoned(handles, kind, message))

    # ---- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return status(self)


def _suspended_message(what: str) -> str:
    return (f"cannot {what}: the session is suspended (its arrays are off the devices and its slices "
            "released); call resume() (session.resume() or pw.resume()) first")


def _stuck_host(conn: WorkerConn) -> str:
    """A host that had not finished a stuck run, as the run's error names it: with how long
    it had been silent while its host still acknowledged (slow: starved of CPU, busy or
    stopped), if it was, since that is where an operator looks first."""
    if conn.silent is None:
        return conn.describe()
    return (f"{conn.describe()}, silent for {conn.silent:.1f} s while its host still acknowledged (a process "
            "starved of CPU, busy, or stopped, e.g. by SIGSTOP or a debugger)")
