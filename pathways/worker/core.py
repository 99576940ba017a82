"""The worker's core: everything a worker does, without processes, sockets it listens on,
or gRPC handlers (server.py is the shell around it), so that it runs and is tested in one
process.

It takes the controller's typed messages (``on_batch`` / ``on_message``), takes arrays
(``receive``: a client's put, a peer's frame, or this host's own send), answers fetches
(``fetch``), and owns the object store, the executable cache, the executor and the
measurer. What it says to the controller goes to ``up`` as typed messages. Its receiving
end of the data plane (receiving.py) and its handlers of suspend and resume
(offloading.py) are base classes of WorkerCore in modules of their own, working on its
state; the pieces it sends and answers with are pieces.py's.

A suspended session's arrays leave the store and the devices (``Offload``): into host
memory or files the worker writes, kept apart until the session resumes; ``Restore`` then
pushes them to the hosts of the new placement as transfer copies, which each receiver
stores under the session's handles (``Adopt``), so peers' frames still carry only the
controller's handles.

Clients' puts (``client_put``) and fetches are served only for handles of the session whose
credential they carry (sessions.py), checked before any of a put's array is read; peers'
frames may only carry the controller's transfer copies, and each copy only from the peers
the controller named as its senders (the receive op of the run that reads it, or the
Adopt of a resume), checked before any of its bytes are read (``screen_frame``).

Arrays cross the data plane as pieces: each sender sends the blocks the receiver's devices
hold (the controller's transfer plan), and a receiver assembles them once every sending
host has delivered. Put headers are msgpack maps from clients and peers, so their fields
are checked here with the protocol's checkers: a malformed one is refused with WireError,
whatever its types.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import jax

from pathways.defaults import CONTROLLER_STOPPED
from pathways.errors import AccessDeniedError, ConnectError, WireError
from pathways.protocol.data import ArrayPut, FetchReply, PENDING, READY
from pathways.protocol.handles import session_of
from pathways.protocol.operator import WorkerStats
from pathways.protocol.messages import (Adopt, Compile, DataKey, Define, Delete, Done, DropSession, FetchRequest, Go,
                                        GroupBroken, Heartbeat, Malformed, Measure, Message, Notice, Offload, Peers,
                                        Poisoned, Restore, RunProgram, Reset, SessionOpen, Shutdown, Step, Timeline,
                                        TimelineFetch, Undelivered, WorkerWelcome, WORKER_DOWN, device_pairs)
from pathways.timeline import RECORDER, now
from pathways.wire import codec, tcp
from pathways.wire.security import Refusals, Security
from pathways.worker.checkpoints import Checkpoints
from pathways.worker.colocated import Colocated
from pathways.worker.profiling import Profile, Profiling
from pathways.worker.compile_cache import CompileCache
from pathways.worker.executables import Executables
from pathways.worker.executor import Executor
from pathways.worker.measure import Measurer
from pathways.worker.offloading import Offloading
from pathways.worker.peers import PeerTickets
from pathways.worker.pieces import device_piece, local_pieces
from pathways.worker.receiving import DeviceArrays, Receiving
from pathways.worker.quota import SessionQuota, default_limit, release_memory, size_text
from pathways.worker.sessions import FetchWaits, Sessions
from pathways.worker.store import ObjectStore, OffloadedArray, Poison, failure

log = logging.getLogger("pathways.worker")

INLINE_SEND_BYTES = 1 << 20  # computed arrays up to this size are sent by the executor itself
# A closed session that held at least this much here (or any function) has the worker hand
# free memory back to the system: collecting and trimming costs milliseconds, not worth it
# for the many small sessions (a status call, a short script) that come and go.
RELEASE_BYTES = 1 << 20
_PENDING = FetchReply(PENDING).header()


class WorkerCore(Receiving, Offloading, Checkpoints, Colocated, Profiling):
    """One worker's state and behaviour. ``up`` takes each message for the controller (an
    outbox's ``put``); ``on_shutdown`` is called when the controller says to stop, and
    ``on_heartbeat(timeout)`` when its heartbeat says how long it tolerates silence, and
    ``on_reset`` (default: ``on_shutdown``) when it says to restart and rejoin the island.
    ``peer_timeout`` (default ``wait_timeout``) bounds how long a data-plane peer may stall
    a connection or a send before it is given up. ``collectives_in_flight``: how many
    multi-device computations may run while the next is launched (0: any; the server sets it
    by ``executor.collectives_bound``). ``session_memory``: the bytes of arrays each client
    session may hold here (quota.py; 0: no limit; None: three quarters of the host's memory)."""

    def __init__(self, up: Callable[[Message], None], wait_timeout: float, collectives_in_flight: int = 0,
                 unsafe_local_order: bool = False, on_shutdown: Callable[[], None] = lambda: None,
                 security: Security | None = None, peer_timeout: float | None = None,
                 on_heartbeat: Callable[[float], None] = lambda timeout: None,
                 on_reset: Optional[Callable[[], None]] = None, suspend_dir: Optional[str] = None,
                 tickets: Optional[PeerTickets] = None, compile_cache: Optional[str] = None,
                 session_memory: Optional[int] = None, checkpoint_dir: Optional[str] = None,
                 colocated_python: bool = False) -> None:
        if not (math.isfinite(wait_timeout) and wait_timeout > 0):
            raise ValueError(f"wait_timeout must be a finite number of seconds above 0, got {wait_timeout!r}")
        self.up = up
        self.wait_timeout = wait_timeout
        self.store = ObjectStore(SessionQuota(
            default_limit(codec.host_memory_bytes()) if session_memory is None else session_memory))
        self._closed_bytes: dict[int, int] = {}  # closed session -> bytes it held here, until its functions go too
        self.fetch_waits = FetchWaits()
        self.sessions = Sessions(self.fetch_waits)
        self.executables = Executables(CompileCache(compile_cache) if compile_cache else None)
        self.peers: dict[int, str] = {}
        # the data plane, greeted with the cluster's token and this worker's ticket for each peer
        self.tickets = tickets or PeerTickets()
        self.peer_timeout = wait_timeout if peer_timeout is None else peer_timeout
        self.links = tcp.Links(self.peer_timeout, security, self.tickets.ticket)
        self.refused_copies = Refusals()  # peers' transfer copies that no run here expected from them
        self.measurer = Measurer(jax, up, security=security, tickets=self.tickets.ticket)
        self.executor = Executor(self.store, self.executables, self, wait_timeout, collectives_in_flight,
                                 unsafe_local_order)
        self._on_shutdown = on_shutdown
        self._on_reset = on_reset or on_shutdown
        self._on_heartbeat = on_heartbeat
        self._put_shardings: dict[str, Any] = {}
        self._device_arrays = DeviceArrays()
        self._send_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pathways-send")
        self._incoming: dict[int, tuple[codec.Assembly, int]] = {}  # handle -> (assembly, senders seen)
        self._incoming_lock = threading.Lock()
        self._released: set[tuple[int, int]] = set()  # (run, node) released by the controller
        self._release = threading.Condition()
        self._probed: set[int] = set()  # peers whose link has been measured (or is being)
        # suspended sessions: their arrays off the devices, and the directory of their files
        self._suspended: dict[int, dict[int, OffloadedArray]] = {}
        # where the operator lets clients have suspended arrays written (`--suspend-dir`); None: nowhere
        self.suspend_dir = os.path.realpath(suspend_dir) if suspend_dir else None
        # where the operator lets clients have checkpoints written and read (`--checkpoint-dir`); None: nowhere
        self.checkpoint_dir = os.path.realpath(checkpoint_dir) if checkpoint_dir else None
        # whether the operator lets clients run colocated Python functions, their code, here
        self.colocated_python = colocated_python
        self._profile: Optional[Profile] = None  # the profile a session takes in this process
        self._profile_lock = threading.Lock()
        self._offload_dirs: dict[int, str] = {}
        self._suspended_lock = threading.Lock()

    @property
    def worker_id(self) -> int:
        return self.executor.worker_id

    # ---- what the executor asks of its host (executor.Controls) ---------------------

    def done(self, reports: list[tuple[int, float]], failed: list[int], values: list[tuple[int, int, bytes]]) -> None:
        self.up(Done(tuple(reports), tuple(failed), tuple(values)))

    def step(self, run: int, node: int) -> None:
        self.up(Step(run, node))

    def broken(self, run: int, message: str) -> None:
        log.warning("run %d: a collective failed, which breaks the island's group: %s", run, message)
        self.up(GroupBroken(run, message))

    def session_dropped(self, session: int, functions: int) -> None:
        """The executor forgot a closed session's ``functions`` (its arrays went when the
        session closed): hand the memory they took back to the system, where it was worth
        something, so that the worker's resident memory falls to what the open sessions hold."""
        nbytes = self._closed_bytes.pop(session, 0)
        if functions or nbytes >= RELEASE_BYTES:
            began = time.perf_counter()
            release_memory()
            log.info("session %d closed: released %s of arrays and %d function(s) in %.1f ms", session,
                     size_text(nbytes), functions, (time.perf_counter() - began) * 1e3)

    def released(self, run: int, node: int, timeout: float) -> bool:
        """Wait until the controller releases ``node`` of ``run`` (sequential dispatch)."""
        key = (run, node)
        with self._release:
            if not self._release.wait_for(lambda: key in self._released, timeout):
                return False
            self._released.discard(key)
        return True

    # ---- control plane --------------------------------------------------------------

    def on_batch(self, payload: bytes) -> None:
        """Handle one payload of the controller's stream; each message that fails its check
        or its handling is answered with a Notice, and the rest of the batch goes on."""
        try:
            batch = WORKER_DOWN.decode_batch(payload)
        except WireError as e:
            self.up(Notice(f"worker {self.worker_id} dropped a batch: {e}"))
            return
        for msg in batch:
            if type(msg) is Malformed:
                self.up(Notice(f"worker {self.worker_id} dropped a {msg.tag!r} message: {msg.error}"))
                continue
            try:
                self.on_message(msg)
            except WireError as e:
                self.up(Notice(f"worker {self.worker_id} dropped a {msg.TAG!r} message: {e}"))

    def on_message(self, msg: Message) -> None:
        """Handle one decoded message from the controller; raises WireError for one this
        worker cannot carry out (a function it cannot compile, a device it lacks)."""
        kind = type(msg)
        if kind is RunProgram or kind is Delete:
            # Expected before the run is queued: its copies may already be arriving.
            if kind is RunProgram and (copies := self.executor.copies_from_peers(msg.key)):
                self.store.expect(msg.tbase, copies)
            if kind is RunProgram and msg.traced:
                began = now()
                self.executor.submit(msg)
                RECORDER.span("receive", began, msg.base, f"run {msg.id}, to the executor's queue")
                return
            self.executor.submit(msg)
        elif kind is Go:
            # At once, not in executor order: the executor is waiting for it.
            with self._release:
                self._released.update((msg.run, n) for n in msg.nodes)
                self._release.notify_all()
        elif kind is Define:
            self.executor.define(msg)
        elif kind is Compile:
            body = msg.body
            if body.format == "xla":
                devices = list(device_pairs(body.devices))
                # the host of the first device tells the controller how it went
                first = devices[0][0] == self.executables.rank
                self.executables.register_xla(msg.fn, body.name, body.blob, body.options, devices, list(msg.workers),
                                              self.up if first else None)
            else:
                self.executables.register(msg.fn, body.name, body.blob, list(body.ins), list(body.outs))
        elif kind is Poisoned:
            for h in msg.handles:
                self._poisoned(h, Poison(msg.message, msg.kind))
        elif kind is SessionOpen:
            self.sessions.open(msg.session, msg.digest)
        elif kind is DropSession:
            # The arrays at once, not in executor order: the executor may be waiting for one
            # the departed client was still sending. Its programs and functions in order:
            # the runs queued before the drop still run (on poison), as on the island's
            # other hosts, whose collectives they meet.
            self.sessions.close(msg.session)
            self._closed_bytes[msg.session] = self.store.drop_session(msg.session)[1]
            self._forget_offloaded(msg.session)
            self._send_pool.submit(self._forget_profile, msg.session)  # stopping writes files: not here
            self.executor.submit(msg)
        elif kind is Offload:
            self._send_pool.submit(self._offload, msg)
        elif kind is Restore:
            self._send_pool.submit(self._restore, msg)
        elif kind is Adopt:
            self._adopt(msg)
        elif kind is Peers:
            self.tickets.learn(msg)
            self.peers.update((worker, address) for worker, address, _ in msg.peers)
            self._measure_new_peers(flops=False)
        elif kind is DataKey:
            self.tickets.learn(msg)
        elif kind is WorkerWelcome:
            self.executor.worker_id = msg.worker
            self.store.refuse_copies_below(msg.copies)
            self._measure_new_peers(flops=True)
        elif kind is Measure:
            self.measurer.request(msg.id, True, self._other_peers())
        elif kind is Shutdown:
            log.log(logging.INFO if msg.reason == CONTROLLER_STOPPED else logging.WARNING,
                    "the controller shut this worker down: %s", msg.reason)
            self._on_shutdown()
        elif kind is Reset:
            log.warning("this worker restarts to join its island again: %s", msg.reason)
            if msg.stacks:  # it had not finished a run its island was stuck or broke on: say where each thread was,
                # whatever the log level (the stacks are written whatever it is)
                print(f"pathways worker: the stacks of this worker's threads (pid {os.getpid()}) as its island "
                      "was reset with a run of it unfinished:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._on_reset()
        elif kind is Heartbeat:
            self._on_heartbeat(msg.timeout)
        elif kind is Notice:
            log.warning("the controller refused a message of this worker: %s", msg.message)

    def _measure_new_peers(self, flops: bool) -> None:
        """Measure the links to peers not measured yet (and the FLOP/s if ``flops``), once
        this worker knows its own id."""
        if self.worker_id < 0:
            return
        new = {p: a for p, a in self._other_peers().items() if p not in self._probed}
        self._probed.update(new)
        if flops or new:
            self.measurer.request(0, flops, new)

    def _other_peers(self) -> dict[int, str]:
        """Every other worker's data address."""
        return {p: a for p, a in self.peers.items() if p != self.worker_id}

    # ---- data plane: sending ----------------------------------------------------------

    def send(self, handle: int, value: Any, layout: list, routes: tuple, run: int = 0) -> None:
        # A small array already computed (tiny computations finish during their dispatch on
        # CPU) goes at once, saving a thread handoff on a pipeline's critical path; anything
        # else is sent from the pool so the executor can go on dispatching.
        if type(value) is not Poison and value.nbytes <= INLINE_SEND_BYTES and value.is_ready():
            self._push(handle, value, layout, routes, run)
        else:
            self._send_pool.submit(self._push, handle, value, layout, routes, run)

    def _push(self, handle: int, value: Any, layout: list, routes: tuple, run: int = 0) -> None:
        """Send each receiver of ``routes`` its regions of ``value``; to this host itself
        the regions are handed over in memory. ``run``: the base of the traced run this
        is a step of (0: untraced), told to the receivers so that they record theirs."""
        if run:
            began = now()
        poison = value if type(value) is Poison else None
        dtype, shape, held = None, (), []
        if poison is None:
            try:
                dtype, shape, held = local_pieces(value)
            except Exception as e:
                poison = failure(f"computing array {handle:#x} on worker {self.worker_id}", e)
        self._deliver(handle, poison, dtype, shape, held, layout, routes, run)
        if run:
            RECORDER.span("send", began, run, f"array {handle:#x} to worker(s) {[r for r, _, _ in routes]}")

    def _deliver(self, handle: int, poison: Optional[Poison], dtype: Any, shape: tuple[int, ...], held: list,
                 layout: list, routes: tuple, run: int = 0) -> None:
        """Send each receiver of ``routes`` its regions of the pieces ``held`` (or the
        ``poison``) as ``handle`` laid out as ``layout`` (wire form)."""
        for receiver, senders, regions in routes:
            put, pieces = self._part(handle, poison, dtype, shape, held, layout, senders, regions, run)
            if receiver == self.worker_id:
                error = self._receive_own(put, pieces)
                if error:
                    log.error("storing array %#x locally failed: %s", handle, error)
                continue
            try:
                self.links.send(self.peers[receiver], put.header(), pieces)
            except (OSError, KeyError, ConnectError) as e:
                log.error("sending array %#x to worker %s failed: %s", handle, receiver, e)
                if session_of(handle) == 0:  # a transfer copy a run of the receiver waits for
                    reason = f"the address of worker {receiver} is not known here" if type(e) is KeyError else e
                    self.up(Undelivered(receiver, (handle,), f"worker {self.worker_id} could not send array "
                                                             f"{handle:#x} to worker {receiver}: {reason}"))

    def _part(self, handle: int, poison: Optional[Poison], dtype: Any, shape: tuple[int, ...], held: list,
              layout: list, senders: int, regions: list, run: int) -> tuple[ArrayPut, list]:
        """One receiver's put of ``handle``: its ``regions`` cut from the pieces ``held``,
        or the poison (a region that cannot be cut poisons the receiver's copy)."""
        if poison is not None:
            return ArrayPut(handle, layout, senders, run=run, poison=poison.message, kind=poison.kind), []
        try:
            pieces = [(region, codec.cut(held, region)) for region in regions]
        except WireError as e:
            return ArrayPut(handle, layout, senders, run=run,
                            poison=f"array {handle:#x} on worker {self.worker_id}: {e}"), []
        return ArrayPut(handle, layout, senders, run=run, pieces=codec.pieces_header(dtype, shape, pieces)), pieces

    # ---- fetches ------------------------------------------------------------------------

    def fetch(self, req: FetchRequest, still_wanted: Callable[[], bool]) -> Iterator[bytes]:
        """The reply frames to a fetch (protocol/data.py FetchReply): PENDING if the array
        is not computed within ``req.wait`` seconds (finite and bounded: FetchRequest's
        checker), an error, READY, or, with ``req.data``, that and the pieces this host
        holds. Stops waiting, with no reply, once ``still_wanted()`` turns false (the
        caller hung up): an abandoned request must not keep its server thread.

        Served only with the credential of the handle's session (else an AccessDeniedError
        reply). A session not announced yet is waited for within ``req.wait`` (pending
        after it), or for ``sessions.wait`` at most when ``req.wait`` is longer. Beyond the
        fetches that may wait at once (sessions.FetchWaits), a fetch is answered at once."""
        if req.wait < self.sessions.wait and not self.sessions.heard_of(session_of(req.handle), req.wait):
            if still_wanted():
                yield codec.pack(_PENDING)
            return
        try:
            self.sessions.admit(req.handle, req.credential, "fetch")
        except AccessDeniedError as e:
            yield codec.pack(FetchReply.error(AccessDeniedError.__name__, str(e)).header())
            return
        session = session_of(req.handle)
        waits = req.wait > 0 and self.fetch_waits.slot(session)
        try:
            yield from self._answer_fetch(req, time.monotonic() + (req.wait if waits else 0.0), still_wanted)
        finally:
            if waits:
                self.fetch_waits.release(session)

    def _answer_fetch(self, req: FetchRequest, deadline: float, still_wanted: Callable[[], bool]) -> Iterator[bytes]:
        """The reply frames to an admitted fetch, waiting until ``deadline`` at most."""
        value = self.store.wait_computed(req.handle, deadline, still_wanted)
        if value is None:
            if still_wanted():
                yield codec.pack(_PENDING)
            return
        if type(value) is Poison:
            yield codec.pack(FetchReply.error(value.kind, value.message).header())
            return
        if not req.data:
            yield codec.pack(FetchReply(READY).header())
            return
        try:
            if req.device:
                dtype, shape, pieces = device_piece(value, self.executables.device(req.device))
            else:
                dtype, shape, pieces = local_pieces(value)
        except Exception as e:
            poison = failure(f"the computation of array {req.handle:#x} on worker {self.worker_id}", e)
            yield codec.pack(FetchReply.error(poison.kind, poison.message).header())
            return
        yield codec.pack(FetchReply(READY, pieces=codec.pieces_header(dtype, shape, pieces)).header())
        yield from codec.pieces_chunks(pieces)

    # ---- timelines -----------------------------------------------------------------------

    def timeline(self, req: TimelineFetch, settle: float = 2.0) -> Timeline:
        """Hand over (and forget) the spans of the traced runs of the session whose
        credential ``req`` carries, waiting up to ``settle`` seconds for its runs still
        running here to report done. Raises AccessDeniedError for a wrong credential, and at
        once for a session not heard of: a client asks the workers that ran its runs, which
        heard of its session before the first of them, so waiting for it (holding one of the
        few gRPC threads) would serve no one."""
        self.sessions.admit_session(req.session, req.credential, f"timeline request of session {req.session}",
                                    "the request is for", wait=0.0)
        events, dropped = RECORDER.take(req.session, req.max_events, settle if req.max_events else 0.0)
        return Timeline(0, now(), os.getpid(), dropped, tuple(events))

    # ---- the rest -------------------------------------------------------------------------

    def stats(self) -> WorkerStats:
        """Counts for the Stats method (and tests): arrays, per session, executables,
        programs, data-plane connections refused for want of a peer's ticket, and peers'
        transfer copies refused for want of a run expecting them from that peer."""
        return WorkerStats(self.worker_id, len(self.store), self.store.session_counts(), self.store.quota.usage(),
                           self.store.quota.limit, len(self.executables), self.executables.compiled(),
                           *self.executables.cache_counts(), self.executor.programs, self.tickets.refused,
                           self.refused_copies.count)

    def close(self) -> None:
        self.measurer.stop()
        self.links.close()
        self.executor.stop()
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        self.executables.close()
