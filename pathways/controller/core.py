"""The controller's state machine. Single-threaded: every call runs on the trio thread.

It owns the resource manager, the gang scheduler, the registered functions and programs
of each client session, the location of every live handle, and the cache of lowered
programs. Sending is done through outboxes (anything with ``put(message)``), so this
module does no I/O. Runs are released by the scheduler (scheduler.py) from this one
thread, so all workers see them in one global order: the gang order that keeps
collectives from deadlocking. Workers report each run done; the reports free window
slots and measure device time for the proportional-share policy. Workers also report
what they measured about themselves (FLOP/s, memory, the latency and bandwidth of their
links to each other): the resource manager breaks placement ties with it, and ``status``
shows it.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pathways.controller.lowering import FnLayouts, Lowered, lower
from pathways.controller.placement import ResourceManager
from pathways.controller.scheduler import DEFAULT_WINDOW, Run, Scheduler
from pathways.errors import PathwaysError, WireError
from pathways.handles import COUNTER_MASK, first_handle, session_of
from pathways.ir import DISPATCH_MODES, Layout, ProgramGraph
from pathways.wire import codec

log = logging.getLogger("pathways.controller")

SESSION_MESSAGES = {
    "hello": {"v": int, "weight": (int, float)},
    "slice": {"req": int, "kind": str, "count": int, "mesh_shape": (list, type(None)),
              "island": (int, type(None)), "exclusive": bool},
    "cluster": {"req": int},
    "fn": {"id": int, "slice": int, "name": str, "blob": bytes, "ins": list, "outs": list},
    "program": {"id": int, "graph": dict, "dispatch": str},
    "run": {"program": int, "base": int, "inputs": list},
    "put": {"handle": int, "layout": list},
    "delete": {"handles": list},
}
WORKER_MESSAGES = {
    "register": {"address": str, "data_address": str, "kind": str, "devices": int, "island": int, "rank": int,
                 "pid": int, "host": str, "memory_bytes": int},
    "done": {"runs": list},  # [[run id, device seconds], ...]
    "step": {"run": int, "node": int},  # a node of a sequentially dispatched run finished
    "error": {"message": str},
    # what a worker measured: job id (0: on its own), FLOP/s (None: not measured), memory,
    # [[peer, latency s, bandwidth B/s], ...] with None, None for a peer that did not answer
    "measured": {"id": int, "flops": (int, float, type(None)), "memory_bytes": int, "links": list},
}
REMOTE, LOST = "RemoteError", "WorkerLostError"  # the error kinds a poisoned handle reports


class Outbox(Protocol):
    def put(self, message: dict) -> None: ...


class RunFailure(PathwaysError):
    """A run cannot be dispatched; its outputs are poisoned with this message."""

    def __init__(self, message: str, kind: str = REMOTE) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class WorkerConn:
    outbox: Outbox
    worker: int = -1
    address: str = ""
    data_address: str = ""  # where peers send it array bytes
    island: int = 0
    rank: int = 0
    kind: str = ""
    devices: int = 0
    pid: int = 0
    host: str = ""
    memory_bytes: int = 0
    defined: set[int] = field(default_factory=set)


@dataclass
class SessionState:
    outbox: Outbox
    slices: set[int] = field(default_factory=set)
    fns: dict[int, FnLayouts] = field(default_factory=dict)
    programs: dict[int, ProgramGraph] = field(default_factory=dict)
    sequential: set[int] = field(default_factory=set)  # programs dispatched node by node
    handles: dict[int, Layout] = field(default_factory=dict)  # live handle -> location
    poisoned: dict[int, tuple[str, str]] = field(default_factory=dict)  # handle -> (kind, message)
    queued_reads: dict[int, int] = field(default_factory=dict)  # handle -> queued runs reading it
    deferred_deletes: dict[int, Layout] = field(default_factory=dict)  # deleted while still to be read
    lowered: dict[tuple, tuple[int, Lowered]] = field(default_factory=dict)


@dataclass
class Dispatch:
    """What a run sends to its workers, and the handles it defines for its session."""

    key: int
    lowered: Lowered
    nvalues: int
    base: int
    tbase: int
    args: dict[int, int]
    outputs: dict[int, int]  # output value -> handle
    waiting: set[int] = field(default_factory=set)  # workers yet to report the run done
    seconds: float = 0.0
    unfinished: dict[int, set[int]] = field(default_factory=dict)  # sequential: node -> workers running it
    finished: set[int] = field(default_factory=set)  # sequential: nodes finished


@dataclass
class Measurement:
    """A request to measure again: the workers yet to report, in the order they are asked
    (the first is measuring now), and what to call when none is left."""

    waiting: list[int]
    done: Callable[[], None]


class ControllerCore:
    def __init__(self, policy: str = "fair", window: int = DEFAULT_WINDOW) -> None:
        self.rm = ResourceManager()
        self.scheduler = Scheduler(policy, window)
        self.workers: dict[int, WorkerConn] = {}
        self.sessions: dict[int, SessionState] = {}
        self.links: dict[tuple[int, int], tuple[float, float]] = {}  # (src, dst) -> (latency s, bytes/s)
        self._measurements: dict[int, Measurement] = {}
        self._measurement_ids = itertools.count(1)
        self._worker_ids = itertools.count(0)
        self._program_keys = itertools.count(1)
        self._next_copy = first_handle(0) + 1

    # ---- workers ---------------------------------------------------------------------

    def on_worker_batch(self, conn: WorkerConn, payload: bytes) -> None:
        try:
            batch = codec.unpack_batch(payload, WORKER_MESSAGES)
        except WireError as e:
            conn.outbox.put({"t": "error", "message": f"controller dropped a batch: {e}"})
            return
        for msg in batch:
            if msg["t"] == "error":
                log.warning("worker %s reported: %s", conn.worker, msg["message"])
            elif msg["t"] == "done":
                self._on_done(conn, msg["runs"])
            elif msg["t"] == "step":
                self._on_step(conn, msg["run"], msg["node"])
            elif msg["t"] == "measured":
                if conn.worker < 0:
                    conn.outbox.put({"t": "error", "message": "a worker reports measurements after it registers"})
                else:
                    self._on_measured(conn, msg)
            elif conn.worker >= 0:
                conn.outbox.put({"t": "error", "message": "worker is already registered"})
            else:
                self._register(conn, msg)

    def _register(self, conn: WorkerConn, msg: dict) -> None:
        if msg["devices"] < 1 or msg["kind"] not in ("cpu", "gpu", "tpu"):
            conn.outbox.put({"t": "error", "message": "register needs devices >= 1 and kind cpu, gpu or tpu"})
            return
        conn.worker = next(self._worker_ids)
        conn.address, conn.island, conn.rank, conn.kind = msg["address"], msg["island"], msg["rank"], msg["kind"]
        conn.data_address = msg["data_address"]
        conn.devices, conn.pid = msg["devices"], msg["pid"]
        conn.host, conn.memory_bytes = msg["host"], msg["memory_bytes"]
        self.workers[conn.worker] = conn
        self.rm.add_host(conn.worker, conn.island, conn.kind, conn.devices, conn.memory_bytes, conn.rank)
        conn.outbox.put({"t": "welcome", "worker": conn.worker})
        peers = {w.worker: w.data_address for w in self.workers.values()}
        for w in self.workers.values():
            w.outbox.put({"t": "peers", "peers": peers})
        log.info("worker %d registered: %d %s device(s) at %s", conn.worker, conn.devices, conn.kind, conn.address)

    def worker_lost(self, conn: WorkerConn) -> None:
        """A worker's stream ended. Its island is unhealthy from now on: a multi-host group
        cannot run without one of its hosts, so every run, array and future that involves
        any host of the island fails with WorkerLostError, and the surviving hosts of the
        island are told to exit. Other islands keep serving."""
        if self.workers.pop(conn.worker, None) is None:
            return
        island = conn.island
        log.warning("worker %d (island %d) at %s was lost", conn.worker, island, conn.address)
        lost = self.rm.lose_island(island)
        message = (f"worker {conn.worker} (pid {conn.pid}, island {island}) was lost; arrays and "
                   f"computations on island {island} are gone. Recreate them on a healthy island "
                   "(`python -m pathways status` shows which are healthy)")
        queued, flying = self.scheduler.cancel(lambda r: bool(r.payload.lowered.workers & lost))
        for run in flying:
            d: Dispatch = run.payload
            self._release_all(run.id, d, lost)
            for sender, receiver, copy in d.lowered.transfers:
                if sender in lost and receiver not in lost and receiver in self.workers:
                    self.workers[receiver].outbox.put({"t": "poison", "handles": [d.tbase + copy - d.nvalues],
                                                      "kind": LOST, "message": message})
        for run in (*queued, *flying):
            self._poison(run.session, run.payload.outputs.values(), LOST, message)
        for run in queued:
            self._reads_done(run)
        for sid, s in self.sessions.items():
            self._poison(sid, [h for h, layout in s.handles.items() if lost & set(layout.workers)], LOST, message)
        for w in lost - {conn.worker}:
            survivor = self.workers.pop(w, None)
            if survivor is not None:
                survivor.outbox.put({"t": "shutdown", "reason": message})
        self.links = {pair: figures for pair, figures in self.links.items() if not lost & set(pair)}
        for mid in list(self._measurements):
            self._measured_by(mid, lost)
        self._pump()

    def _poison(self, sid: int, handles: Any, kind: str, message: str) -> None:
        s = self.sessions.get(sid)
        handles = list(handles)
        if s is None or not handles:
            return
        for h in handles:
            s.poisoned[h] = (kind, message)
        s.outbox.put({"t": "poisoned", "handles": handles, "kind": kind, "message": message})

    # ---- measurements ------------------------------------------------------------------

    def measure(self, done: Callable[[], None]) -> int:
        """Have every worker measure itself again, one at a time so that their probes and
        matmuls do not disturb each other's figures (on a machine shared by several workers,
        each then reports what the machine gives one worker alone); ``done()`` is called
        once all have reported or were lost. Returns the request's id."""
        mid = next(self._measurement_ids)
        self._measurements[mid] = Measurement(sorted(self.workers), done)
        self._ask_next(mid)
        return mid

    def abandon_measurement(self, mid: int) -> list[int]:
        """Stop measurement ``mid``; returns the workers that did not report, the first of
        them the one measuring (the others were not asked yet)."""
        m = self._measurements.pop(mid, None)
        return list(m.waiting) if m is not None else []

    def _measured_by(self, mid: int, workers: set[int]) -> None:
        m = self._measurements.get(mid)
        if m is None:
            return
        measuring = m.waiting[0]
        m.waiting = [w for w in m.waiting if w not in workers]
        if measuring in workers:
            self._ask_next(mid)

    def _ask_next(self, mid: int) -> None:
        m = self._measurements[mid]
        m.waiting = [w for w in m.waiting if w in self.workers]
        if not m.waiting:
            del self._measurements[mid]
            m.done()
            return
        self.workers[m.waiting[0]].outbox.put({"t": "measure", "id": mid})

    def _on_measured(self, conn: WorkerConn, msg: dict) -> None:
        flops = msg["flops"]
        if flops is not None:
            if math.isfinite(flops) and flops > 0:
                self.rm.set_flops(conn.worker, float(flops))
            else:
                conn.outbox.put({"t": "error", "message": f"measured flops must be positive, got {flops!r}"})
        if msg["memory_bytes"] > 0:
            conn.memory_bytes = msg["memory_bytes"]
            if conn.worker in self.rm.hosts:
                self.rm.hosts[conn.worker].memory_bytes = conn.memory_bytes
        else:
            conn.outbox.put({"t": "error", "message": f"measured memory_bytes must be positive, "
                                                      f"got {msg['memory_bytes']!r}"})
        for entry in msg["links"]:
            if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int
                    and entry[0] != conn.worker and _link_figures(entry[1:])):
                conn.outbox.put({"t": "error", "message": "a measured link must be [peer, latency, bandwidth], "
                                                          f"both positive or both None; got {entry!r}"})
                continue
            peer, latency, bandwidth = entry
            if peer not in self.workers:
                continue
            if latency is None:
                self.links.pop((conn.worker, peer), None)
            else:
                self.links[(conn.worker, peer)] = (float(latency), float(bandwidth))
            self.rm.set_latency(conn.worker, peer, latency)
        self._measured_by(msg["id"], {conn.worker})

    # ---- sessions --------------------------------------------------------------------

    def session_opened(self, sid: int, outbox: Outbox) -> None:
        self.sessions[sid] = SessionState(outbox)
        self.scheduler.add_session(sid)

    def session_closed(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is None:
            return
        self.scheduler.remove_session(sid)
        self.rm.release_owner(sid)
        for w in self.workers.values():
            w.outbox.put({"t": "drop_session", "session": sid})
        log.info("session %d closed: freed %d array(s) and %d slice(s)", sid, len(s.handles), len(s.slices))

    def on_session_batch(self, sid: int, payload: bytes) -> None:
        s = self.sessions.get(sid)
        if s is None:
            return
        try:
            batch = codec.unpack_batch(payload, SESSION_MESSAGES)
        except WireError as e:
            s.outbox.put({"t": "error", "req": None, "message": f"controller dropped a batch: {e}"})
            return
        for msg in batch:
            try:
                getattr(self, "_on_" + msg["t"])(sid, s, msg)
            except PathwaysError as e:
                s.outbox.put({"t": "error", "req": msg.get("req"), "kind": type(e).__name__,
                              "message": f"{msg['t']}: {e}"})

    def _own(self, sid: int, ident: int, what: str) -> int:
        if session_of(ident) != sid:
            raise WireError(f"{what} {ident:#x} does not belong to this session")
        return ident

    def _on_hello(self, sid: int, s: SessionState, msg: dict) -> None:
        if msg["v"] != codec.PROTOCOL_VERSION:
            raise WireError(f"client speaks protocol {msg['v']}, controller speaks "
                            f"{codec.PROTOCOL_VERSION}; install the same pathways version on both")
        if not 0 < msg["weight"] <= 1e6:
            raise WireError(f"a session's weight must be in (0, 1e6], got {msg['weight']!r}")
        self.scheduler.set_weight(sid, msg["weight"])
        s.outbox.put({"t": "welcome", "session": sid})

    def _on_cluster(self, sid: int, s: SessionState, msg: dict) -> None:
        s.outbox.put({"t": "cluster", "req": msg["req"], **self.status()})

    def _on_slice(self, sid: int, s: SessionState, msg: dict) -> None:
        p = self.rm.place(msg["count"], msg["kind"],
                          tuple(codec.int_list(msg["mesh_shape"], "mesh_shape")) if msg["mesh_shape"] else None,
                          msg["island"], msg["exclusive"], owner=sid)
        s.slices.add(p.slice_id)
        s.outbox.put({"t": "slice", "req": msg["req"], "slice": p.slice_id, "workers": list(p.workers),
                      "addresses": [self.workers[w].address for w in p.workers], "island": p.island,
                      "devices": [x for d in p.devices for x in d], "mesh_shape": list(p.mesh_shape)})

    def _on_fn(self, sid: int, s: SessionState, msg: dict) -> None:
        fn = self._own(sid, msg["id"], "function")
        placement = self.rm.slices.get(msg["slice"])
        if placement is None or msg["slice"] not in s.slices:
            raise WireError(f"slice {msg['slice']} is not one of this session's slices")
        ins = [Layout.from_wire(x) for x in msg["ins"]]
        outs = [Layout.from_wire(x) for x in msg["outs"]]
        for layout in (*ins, *outs):
            if layout.workers != placement.workers or layout.devices != placement.devices:
                raise WireError(f"function {msg['name']!r} names devices outside its slice")
        gone = [w for w in placement.workers if w not in self.workers]
        if gone:
            raise WireError(f"slice {msg['slice']} lost its worker(s) {gone}; ask for a new slice")
        s.fns[fn] = FnLayouts(placement.workers, tuple(ins), tuple(outs))
        for w in placement.workers:
            self.workers[w].outbox.put({"t": "compile", "fn": fn, "name": msg["name"], "blob": msg["blob"],
                                        "ins": msg["ins"], "outs": msg["outs"]})

    def _on_program(self, sid: int, s: SessionState, msg: dict) -> None:
        program = self._own(sid, msg["id"], "program")
        if msg["dispatch"] not in DISPATCH_MODES:
            raise WireError(f"dispatch {msg['dispatch']!r} is neither 'parallel' nor 'sequential'")
        s.programs[program] = ProgramGraph.from_wire(msg["graph"])
        if msg["dispatch"] == "sequential":
            s.sequential.add(program)

    def _on_put(self, sid: int, s: SessionState, msg: dict) -> None:
        handle = self._own(sid, msg["handle"], "handle")
        layout = Layout.from_wire(msg["layout"])
        gone = [w for w in layout.workers if w not in self.workers]
        if gone:
            self._poison(sid, [handle], LOST, f"the array was put on worker(s) {gone}, which are gone; "
                                              "put it on a slice of a healthy island")
            return
        s.handles[handle] = layout

    def _on_delete(self, sid: int, s: SessionState, msg: dict) -> None:
        doomed: dict[int, Layout] = {}
        for h in codec.int_list(msg["handles"], "delete handles"):
            s.poisoned.pop(h, None)
            layout = s.handles.pop(h, None) if session_of(h) == sid else None
            if layout is None:
                continue
            if s.queued_reads.get(h):
                s.deferred_deletes[h] = layout  # a queued run still reads it: delete after dispatch
            else:
                doomed[h] = layout
        self._send_deletes(doomed)

    def _send_deletes(self, doomed: dict[int, Layout]) -> None:
        by_worker: dict[int, list[int]] = {}
        for h, layout in doomed.items():
            for w in layout.workers:
                by_worker.setdefault(w, []).append(h)
        for worker, handles in by_worker.items():
            if worker in self.workers:
                self.workers[worker].outbox.put({"t": "delete", "handles": handles})

    def _on_run(self, sid: int, s: SessionState, msg: dict) -> None:
        graph = s.programs.get(msg["program"])
        if graph is None:
            raise WireError(f"program {msg['program']} was never registered by this session")
        base = self._own(sid, msg["base"], "handle base")
        if (base & COUNTER_MASK) + graph.nvalues > COUNTER_MASK:
            raise WireError("handle base leaves no room for the program's values")
        args: dict[int, int] = {}
        for pair in msg["inputs"]:
            v, h = codec.int_list(pair, "run input")
            args[v] = h
        if set(args) != set(graph.inputs):
            raise WireError(f"run binds inputs {sorted(args)}; the program has {sorted(graph.inputs)}")
        outputs = {v: args.get(v, base + v) for v in graph.outputs}
        try:
            key, lowered = self._lowered(s, msg["program"], graph, args)
        except RunFailure as e:
            self._poison(sid, outputs.values(), e.kind, str(e))
            return
        tbase = self._next_copy
        self._next_copy += lowered.ncopies
        for v, h in outputs.items():
            if v not in args:
                s.handles[h] = lowered.output_layouts[v]
        for h in args.values():
            s.queued_reads[h] = s.queued_reads.get(h, 0) + 1
        islands = frozenset(self.workers[w].island for w in lowered.workers)
        self.scheduler.submit(Run(sid, islands, key, Dispatch(key, lowered, graph.nvalues, base, tbase, args,
                                                              {v: h for v, h in outputs.items() if v not in args})))
        self._pump()

    def _pump(self) -> None:
        """Dispatch whatever the scheduler releases, in its order, to every worker involved."""
        for run in self.scheduler.dispatchable():
            d: Dispatch = run.payload
            d.waiting = set(d.lowered.workers)
            if d.lowered.gates is not None:
                d.unfinished = {n: set(ws) for n, ws in d.lowered.gates.steps.items()}
            for worker, ops in d.lowered.ops.items():
                conn = self.workers[worker]
                if d.key not in conn.defined:
                    conn.outbox.put({"t": "define", "key": d.key, "nvalues": d.nvalues,
                                     "ncopies": d.lowered.ncopies, "ops": ops})
                    conn.defined.add(d.key)
                conn.outbox.put({"t": "run", "id": run.id, "key": d.key, "base": d.base, "tbase": d.tbase,
                                 "args": d.args})
            self._reads_done(run)

    def _reads_done(self, run: Run) -> None:
        """A run left the queue (dispatched or dropped): deletes it held back can go now."""
        s = self.sessions.get(run.session)
        if s is None:
            return
        ready: dict[int, Layout] = {}
        for h in run.payload.args.values():
            left = s.queued_reads.get(h, 0) - 1
            if left > 0:
                s.queued_reads[h] = left
                continue
            s.queued_reads.pop(h, None)
            if h in s.deferred_deletes:
                ready[h] = s.deferred_deletes.pop(h)
        self._send_deletes(ready)

    def _on_done(self, conn: WorkerConn, reports: list) -> None:
        for report in reports:
            if not (isinstance(report, list) and len(report) == 2 and isinstance(report[0], int)
                    and isinstance(report[1], (int, float))):
                conn.outbox.put({"t": "error", "message": f"a done report must be [run, seconds], got {report!r}"})
                continue
            run = self.scheduler.running(report[0])
            if run is None:
                continue
            d: Dispatch = run.payload
            d.waiting.discard(conn.worker)
            d.seconds += max(float(report[1]), 0.0)
            if not d.waiting:
                self.scheduler.finish(run.id, d.seconds)
        self._pump()

    def _on_step(self, conn: WorkerConn, run_id: int, node: int) -> None:
        """A worker finished its part of ``node`` of a sequential run: release the nodes
        whose every predecessor has now finished."""
        run = self.scheduler.running(run_id)
        if run is None or run.payload.lowered.gates is None:
            return
        d: Dispatch = run.payload
        gates = d.lowered.gates
        left = d.unfinished.get(node)
        if left is None or conn.worker not in left:
            return
        left.discard(conn.worker)
        if left:
            return
        d.finished.add(node)
        go: dict[int, list[int]] = {}
        for succ in gates.succs.get(node, ()):
            if all(p in d.finished for p in gates.preds[succ]):
                for w in gates.waits.get(succ, ()):
                    go.setdefault(w, []).append(succ)
        self._send_go(run_id, go)

    def _release_all(self, run_id: int, d: Dispatch, lost: set[int]) -> None:
        """A cancelled sequential run: let the surviving workers through its gates (their
        inputs are poisoned, so what they compute is too) instead of waiting forever."""
        gates = d.lowered.gates
        if gates is None:
            return
        go: dict[int, list[int]] = {}
        for node, workers in gates.waits.items():
            for w in workers:
                if w not in lost:
                    go.setdefault(w, []).append(node)
        self._send_go(run_id, go)

    def _send_go(self, run_id: int, go: dict[int, list[int]]) -> None:
        """Release nodes of a sequential run: worker -> the nodes it may now run."""
        for w, nodes in go.items():
            if w in self.workers:
                self.workers[w].outbox.put({"t": "go", "run": run_id, "nodes": nodes})

    def _lowered(self, s: SessionState, program: int, graph: ProgramGraph,
                 args: dict[int, int]) -> tuple[int, Lowered]:
        layouts: dict[int, Layout] = {}
        for v, h in args.items():
            if h in s.poisoned:
                kind, message = s.poisoned[h]
                raise RunFailure(message, kind)
            layout = s.handles.get(h)
            if layout is None:
                raise RunFailure(f"input array {h:#x} was deleted or never created")
            if any(w not in self.workers for w in layout.workers):
                raise RunFailure(f"input array {h:#x} lived on workers {list(layout.workers)}, "
                                 "one of which is gone", LOST)
            layouts[v] = layout
        cache_key = (program, tuple(sorted(layouts.items())))
        hit = s.lowered.get(cache_key)
        if hit is None:
            try:
                lowered = lower(graph, s.fns, layouts, program in s.sequential)
            except WireError as e:
                raise RunFailure(str(e)) from None
            except Exception as e:  # a bug must fail the run at once, not leave its outputs unresolved
                log.exception("lowering program %#x failed", program)
                raise RunFailure(f"the controller could not lower this program ({type(e).__name__}: {e}); "
                                 "this is a bug in pathways, please report it with the program") from None
            hit = (next(self._program_keys), lowered)
            s.lowered[cache_key] = hit
        gone = [w for w in hit[1].ops if w not in self.workers]
        if gone:
            raise RunFailure(f"the program needs worker(s) {gone}, which are gone; compile it for a "
                             "slice of a healthy island", LOST)
        return hit

    # ---- status ----------------------------------------------------------------------

    def _host_figures(self, worker: int) -> dict[str, Any]:
        """A worker's measured FLOP/s (None until measured) and slices per device, as the
        resource manager holds them."""
        host = self.rm.hosts.get(worker)
        if host is None:
            return {"flops": None, "load": []}
        return {"flops": host.flops or None, "load": list(host.load)}

    def status(self) -> dict[str, Any]:
        islands = sorted({w.island for w in self.workers.values()} | self.rm.unhealthy)
        return {
            "policy": self.scheduler.policy,
            "window": self.scheduler.window,
            "islands": [{"island": i, "healthy": i not in self.rm.unhealthy,
                         "hosts": sum(1 for w in self.workers.values() if w.island == i),
                         "devices": sum(w.devices for w in self.workers.values() if w.island == i),
                         "queued": self.scheduler.queued(i), "inflight": self.scheduler.inflight(i)}
                        for i in islands],
            "workers": [{"worker": w.worker, "address": w.address, "data_address": w.data_address,
                         "island": w.island, "rank": w.rank,
                         "kind": w.kind, "devices": w.devices, "pid": w.pid, "host": w.host,
                         "memory_bytes": w.memory_bytes, **self._host_figures(w.worker)}
                        for w in self.workers.values()],
            "links": [{"src": src, "dst": dst, "latency": latency, "bandwidth": bandwidth}
                      for (src, dst), (latency, bandwidth) in sorted(self.links.items())],
            "sessions": [{"session": sid, "slices": len(s.slices), "arrays": len(s.handles),
                          **self.scheduler.session_stats(sid)} for sid, s in self.sessions.items()],
            "slices": len(self.rm.slices),
            "arrays": sum(len(s.handles) for s in self.sessions.values()),
        }


def _link_figures(figures: list) -> bool:
    """Whether a measured link's [latency, bandwidth] are both positive numbers or both None."""
    if figures == [None, None]:
        return True
    return all(type(x) in (int, float) and math.isfinite(x) and x > 0 for x in figures)
