"""The controller's core: typed messages in, typed messages out. Every call runs on the
transport's event-loop thread; sending goes through outboxes (anything with
``put(message)``), so nothing here does I/O and all of it runs without processes. One
reader on other threads: the IFRT front end's data-plane pool looks up a worker's data
address in ``membership.data_routes``, a dict lookup, atomic under the GIL.

It composes parts with one job each: worker membership and measurements
(membership.py), placement (placement.py), each session's handle table (handles.py) and
programs with their lowerings (programs.py), dispatch through the gang scheduler
(dispatch.py, scheduler.py), and the suspend and resume of sessions (suspension.py). Its
handlers are grouped by feature, each group a base class of ControllerCore in a module of
its own working on the core's state: lost hosts and healing (healing.py), retirements
(retiring.py), functions and their compiles (compiling.py), suspend and resume
(suspending.py); the records it keeps are in state.py. The
transport shell (server.py) decodes payloads with the protocol's tables and calls
``on_session_batch`` / ``on_worker_batch``; a second front end drives a session through
the same typed messages with ``on_session_message``. Islands that lost a host heal when
their hosts join again (``worker_lost``, ``_healed``); an operator retires an island or a
host for good (``retire``, then ``finish_retirement`` once its runs drained or the shell's
wait ran out), and lost islands nobody rejoins are forgotten beyond
retiring.MAX_LOST_ISLANDS.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from typing import Callable, Iterable, Optional, Union

from pathways.controller.compiling import Compiling
from pathways.controller.dispatch import Dispatch, Dispatcher, coalesce
from pathways.controller.healing import Healing
from pathways.controller.islands import Islands, Recovery
from pathways.controller.membership import Membership, MessageSink, WorkerConn
from pathways.controller.placement import ResourceManager
from pathways.controller.programs import RunFailure
from pathways.controller.retiring import Retiring
from pathways.controller.scheduler import DEFAULT_WINDOW, ScheduledRun, Scheduler
from pathways.controller.state import Retirement, SessionState
from pathways.controller.status import status
from pathways.controller.suspending import Suspending, suspended_message
from pathways.errors import AccessDeniedError, PathwaysError, WireError
from pathways.ir import Layout, ProgramGraph
from pathways.protocol import messages as m
from pathways.protocol.check import clip_text
from pathways.protocol.errors import DENIED, LOST, SUSPENDED as SUSPENDED_KIND, kind_of
from pathways.protocol.handles import first_handle, fits, session_of
from pathways.protocol.messages import Health
from pathways.timeline import RECORDER, now

log = logging.getLogger("pathways.controller")

__all__ = ["ControllerCore", "WorkerConn", "MessageSink", "Retirement"]


class ControllerCore(Healing, Retiring, Compiling, Suspending):
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
        self._clock = clock
        # island -> (when it is reset, the member that said its group broke, the run, why): see Healing
        self._broken: dict[int, tuple[float, WorkerConn, int, str]] = {}
        self.sessions: dict[int, SessionState] = {}
        self._next_copy = first_handle(0) + 1  # transfer copies are the controller's handles
        self._draining: set[int] = set()  # sessions suspending that wait for their runs to finish
        self._retirements: dict[int, Retirement] = {}
        self._retirement_ids = itertools.count(1)
        # worker -> why it is gone for good (its island retired or forgotten), for the
        # errors of sessions that still use it; the latest MAX_WORKERS
        self._gone_why: dict[int, str] = {}
        # the array bytes of the front end served beside this controller, if one is (set
        # by the server that starts it): for the status
        self.front_end_traffic: Optional[Callable[[], m.ArrayTraffic]] = None

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
            finished = self.dispatcher.done(conn, msg.runs, msg.failed, msg.values)
            if finished:
                self._computed(finished)
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
        elif kind is m.GroupBroken:
            self._group_broken(conn, msg)
        elif kind is m.Adopted:
            self._adopted(conn, msg)
        elif kind is m.Heartbeat:
            conn.heartbeat = msg.timeout  # the shell paces its heartbeats to it
        elif kind is m.Notice:
            log.warning("worker %s reported: %s", conn.worker, msg.message)
        else:  # Malformed
            conn.outbox.put(m.Notice(f"controller dropped {msg.tag!r}: {msg.error}"))

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
            self._poison(sid, [handle], SUSPENDED_KIND, suspended_message("put an array"))
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
                         suspended_message("run a program"))
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
        d = Dispatch(key, lowered, graph.nvalues, base, tbase, args, fresh, traced=msg.traced, notify=msg.notify)
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

    def _computed(self, runs: list[ScheduledRun]) -> None:
        """Every worker finished ``runs``: tell each session which outputs of the parts that
        asked (Run.notify) were computed, in one message per session and outcome (runs
        reported together are most often a client's calls one after the other)."""
        told: dict[tuple[int, bool], tuple[list[int], list[tuple[int, bytes]]]] = {}
        for run in runs:
            d: Dispatch = run.payload
            handles = d.told
            if handles:
                into = told.setdefault((run.session, d.failed), ([], []))
                into[0].extend(handles)
                if not d.failed:
                    into[1].extend(d.values.items())
        for (sid, failed), (handles, values) in told.items():
            s = self.sessions.get(sid)
            if s is not None:
                s.outbox.put(m.Computed(tuple(handles), failed, tuple(values[:m.MAX_SMALL_VALUES])))

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

    _handlers: dict[type, Callable] = {
        m.Hello: _hello, m.ClusterRequest: _cluster, m.SliceRequest: _slice, m.DefineFunction: Compiling._fn,
        m.DefineProgram: _program, m.PutNotice: _put, m.Delete: _delete, m.Run: _run,
        m.CollectTimeline: _timeline, m.Suspend: Suspending._suspend, m.Resume: Suspending._resume,
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

    def status(self) -> m.ClusterStatus:
        return status(self)


