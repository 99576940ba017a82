"""Suspending and resuming sessions: a part of the controller core (ControllerCore),
working on its state; suspension.py holds the pure state of each suspend and resume."""

from __future__ import annotations

import logging

from pathways.controller.membership import WorkerConn
from pathways.controller.programs import XlaCompile
from pathways.controller.state import SessionState
from pathways.controller.suspension import DRAINING, OFFLOADING, RESUMING, SUSPENDED, Remap, Suspension
from pathways.controller.transfers import plan
from pathways.errors import PlacementError, SuspendedError
from pathways.protocol import messages as m
from pathways.protocol.errors import LOST, REMOTE

log = logging.getLogger("pathways.controller")


class Suspending:
    """ControllerCore's handlers of Suspend and Resume, and the steps in between."""

    # ---- suspend and resume (suspension.py) ---------------------------------------------

    @staticmethod
    def _refuse_if_suspended(s: SessionState, what: str) -> None:
        if s.suspension is not None:
            raise SuspendedError(suspended_message(what))

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


def suspended_message(what: str) -> str:
    return (f"cannot {what}: the session is suspended (its arrays are off the devices and its slices "
            "released); call resume() (session.resume() or pw.resume()) first")
