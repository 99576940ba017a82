"""The controller's state machine. Single-threaded: every call runs on the trio thread.

It owns the resource manager, the registered functions and programs of each client
session, the location of every live handle, and the cache of lowered programs. Sending
is done through outboxes (anything with ``put(message)``), so this module does no I/O.
Because one thread emits every worker's runs, all workers see programs in one global
order: that is the gang order that keeps collectives from deadlocking.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from pathways.controller.lowering import FnLayouts, Lowered, lower
from pathways.controller.placement import ResourceManager
from pathways.errors import PathwaysError, WireError
from pathways.handles import COUNTER_MASK, first_handle, session_of
from pathways.ir import Layout, ProgramGraph
from pathways.wire import codec

log = logging.getLogger("pathways.controller")

SESSION_MESSAGES = {
    "hello": {"v": int},
    "slice": {"req": int, "kind": str, "count": int, "mesh_shape": (list, type(None)),
              "island": (int, type(None)), "exclusive": bool},
    "cluster": {"req": int},
    "fn": {"id": int, "slice": int, "name": str, "blob": bytes, "ins": list, "outs": list},
    "program": {"id": int, "graph": dict},
    "run": {"program": int, "base": int, "inputs": list},
    "put": {"handle": int, "layout": list},
    "delete": {"handles": list},
}
WORKER_MESSAGES = {
    "register": {"address": str, "kind": str, "devices": int, "island": int, "pid": int,
                 "host": str, "memory_bytes": int},
    "error": {"message": str},
}


class Outbox(Protocol):
    def put(self, message: dict) -> None: ...


class RunFailure(PathwaysError):
    """A run cannot be dispatched; its outputs are poisoned with this message."""


@dataclass
class WorkerConn:
    outbox: Outbox
    worker: int = -1
    address: str = ""
    island: int = 0
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
    handles: dict[int, Layout] = field(default_factory=dict)  # live handle -> location
    poisoned: dict[int, str] = field(default_factory=dict)
    lowered: dict[tuple, tuple[int, Lowered]] = field(default_factory=dict)


class ControllerCore:
    def __init__(self) -> None:
        self.rm = ResourceManager()
        self.workers: dict[int, WorkerConn] = {}
        self.sessions: dict[int, SessionState] = {}
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
            elif conn.worker >= 0:
                conn.outbox.put({"t": "error", "message": "worker is already registered"})
            else:
                self._register(conn, msg)

    def _register(self, conn: WorkerConn, msg: dict) -> None:
        if msg["devices"] < 1 or msg["kind"] not in ("cpu", "gpu", "tpu"):
            conn.outbox.put({"t": "error", "message": "register needs devices >= 1 and kind cpu, gpu or tpu"})
            return
        conn.worker = next(self._worker_ids)
        conn.address, conn.island, conn.kind = msg["address"], msg["island"], msg["kind"]
        conn.devices, conn.pid = msg["devices"], msg["pid"]
        conn.host, conn.memory_bytes = msg["host"], msg["memory_bytes"]
        self.workers[conn.worker] = conn
        self.rm.add_host(conn.worker, conn.island, conn.kind, conn.devices, conn.memory_bytes)
        conn.outbox.put({"t": "welcome", "worker": conn.worker})
        peers = {w.worker: w.address for w in self.workers.values()}
        for w in self.workers.values():
            w.outbox.put({"t": "peers", "peers": peers})
        log.info("worker %d registered: %d %s device(s) at %s", conn.worker, conn.devices, conn.kind, conn.address)

    def worker_lost(self, conn: WorkerConn) -> None:
        if self.workers.pop(conn.worker, None) is not None:
            self.rm.hosts.pop(conn.worker, None)
            log.info("worker %d at %s disconnected", conn.worker, conn.address)

    # ---- sessions --------------------------------------------------------------------

    def session_opened(self, sid: int, outbox: Outbox) -> None:
        self.sessions[sid] = SessionState(outbox)

    def session_closed(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is None:
            return
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
        s.outbox.put({"t": "welcome", "session": sid})

    def _on_cluster(self, sid: int, s: SessionState, msg: dict) -> None:
        s.outbox.put({"t": "cluster", "req": msg["req"], **self.status()})

    def _on_slice(self, sid: int, s: SessionState, msg: dict) -> None:
        p = self.rm.place(msg["count"], msg["kind"],
                          tuple(codec.int_list(msg["mesh_shape"], "mesh_shape")) if msg["mesh_shape"] else None,
                          msg["island"], msg["exclusive"], owner=sid)
        s.slices.add(p.slice_id)
        w = self.workers[p.worker]
        s.outbox.put({"t": "slice", "req": msg["req"], "slice": p.slice_id, "worker": p.worker,
                      "address": w.address, "island": p.island, "devices": list(p.devices),
                      "mesh_shape": list(p.mesh_shape)})

    def _on_fn(self, sid: int, s: SessionState, msg: dict) -> None:
        fn = self._own(sid, msg["id"], "function")
        placement = self.rm.slices.get(msg["slice"])
        if placement is None or msg["slice"] not in s.slices:
            raise WireError(f"slice {msg['slice']} is not one of this session's slices")
        ins = [Layout.from_wire(x) for x in msg["ins"]]
        outs = [Layout.from_wire(x) for x in msg["outs"]]
        for layout in (*ins, *outs):
            if layout.worker != placement.worker or layout.devices != placement.devices:
                raise WireError(f"function {msg['name']!r} names devices outside its slice")
        s.fns[fn] = FnLayouts(placement.worker, tuple(ins), tuple(outs))
        self.workers[placement.worker].outbox.put(
            {"t": "compile", "fn": fn, "name": msg["name"], "blob": msg["blob"],
             "ins": msg["ins"], "outs": msg["outs"]})

    def _on_program(self, sid: int, s: SessionState, msg: dict) -> None:
        program = self._own(sid, msg["id"], "program")
        s.programs[program] = ProgramGraph.from_wire(msg["graph"])

    def _on_put(self, sid: int, s: SessionState, msg: dict) -> None:
        handle = self._own(sid, msg["handle"], "handle")
        layout = Layout.from_wire(msg["layout"])
        if layout.worker not in self.workers:
            raise WireError(f"put names worker {layout.worker}, which is not attached")
        s.handles[handle] = layout

    def _on_delete(self, sid: int, s: SessionState, msg: dict) -> None:
        by_worker: dict[int, list[int]] = {}
        for h in codec.int_list(msg["handles"], "delete handles"):
            s.poisoned.pop(h, None)
            layout = s.handles.pop(h, None) if session_of(h) == sid else None
            if layout is not None:
                by_worker.setdefault(layout.worker, []).append(h)
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
            for h in outputs.values():
                s.poisoned[h] = str(e)
            s.outbox.put({"t": "poisoned", "handles": list(outputs.values()), "message": str(e)})
            return
        tbase = self._next_copy
        self._next_copy += lowered.ncopies
        for worker, ops in lowered.ops.items():
            conn = self.workers[worker]
            if key not in conn.defined:
                conn.outbox.put({"t": "define", "key": key, "nvalues": graph.nvalues,
                                 "ncopies": lowered.ncopies, "ops": ops})
                conn.defined.add(key)
            conn.outbox.put({"t": "run", "key": key, "base": base, "tbase": tbase, "args": args})
        for v, h in outputs.items():
            if v not in args:
                s.handles[h] = lowered.output_layouts[v]

    def _lowered(self, s: SessionState, program: int, graph: ProgramGraph,
                 args: dict[int, int]) -> tuple[int, Lowered]:
        layouts: dict[int, Layout] = {}
        for v, h in args.items():
            if h in s.poisoned:
                raise RunFailure(s.poisoned[h])
            layout = s.handles.get(h)
            if layout is None:
                raise RunFailure(f"input array {h:#x} was deleted or never created")
            if layout.worker not in self.workers:
                raise RunFailure(f"input array {h:#x} lived on worker {layout.worker}, which is gone")
            layouts[v] = layout
        cache_key = (program, tuple(sorted(layouts.items())))
        hit = s.lowered.get(cache_key)
        if hit is None:
            try:
                lowered = lower(graph, s.fns, layouts)
            except WireError as e:
                raise RunFailure(str(e)) from None
            hit = (next(self._program_keys), lowered)
            s.lowered[cache_key] = hit
        gone = [w for w in hit[1].ops if w not in self.workers]
        if gone:
            raise RunFailure(f"the program needs worker(s) {gone}, which are gone")
        return hit

    # ---- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "workers": [{"worker": w.worker, "address": w.address, "island": w.island,
                         "kind": w.kind, "devices": w.devices, "pid": w.pid, "host": w.host,
                         "memory_bytes": w.memory_bytes,
                         "load": list(self.rm.hosts[w.worker].load) if w.worker in self.rm.hosts else []}
                        for w in self.workers.values()],
            "sessions": len(self.sessions),
            "slices": len(self.rm.slices),
            "arrays": sum(len(s.handles) for s in self.sessions.values()),
        }

