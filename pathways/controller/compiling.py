"""Defining functions: a part of the controller core (ControllerCore), working on its state.
A function is compiled on every host of its slice (jax.export functions and XLA programs
alike); each host answers with the layouts it compiled, and the session hears once all have."""

from __future__ import annotations

import logging

from pathways.controller.lowering import FnLayouts
from pathways.controller.membership import WorkerConn
from pathways.controller.placement import SlicePlacement
from pathways.controller.programs import XlaCompile
from pathways.controller.state import SessionState
from pathways.errors import PathwaysError, PlacementError, WireError, WorkerLostError
from pathways.protocol import messages as m
from pathways.protocol.errors import kind_of
from pathways.protocol.handles import session_of

log = logging.getLogger("pathways.controller")


class Compiling:
    """ControllerCore's definitions of functions and their compiles on the workers."""

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
