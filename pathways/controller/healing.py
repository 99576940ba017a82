"""Hosts lost and islands healed: a part of the controller core (ControllerCore), working on
its state. A worker's stream that ends loses its host; the runs of an island that lost one
fail at once, and the island heals once its hosts join again; an island whose runs stall
past the run timeout, or whose group broke in a collective, is reset."""

from __future__ import annotations

import logging
from typing import Callable

from pathways.controller.membership import WorkerConn
from pathways.controller.scheduler import ScheduledRun
from pathways.protocol import messages as m
from pathways.protocol.errors import LOST, REMOTE, STUCK

log = logging.getLogger("pathways.controller")

# How long the reset of an island whose group broke waits for a loss that explains it: a
# killed host breaks its peers' collectives about when its connection closes, and the loss,
# which names the host, is the better error.
BROKEN_GRACE_SECONDS = 2.0


class Healing:
    """ControllerCore's handling of lost hosts, stuck runs and healed islands."""

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

    def _group_broken(self, conn: WorkerConn, msg: m.GroupBroken) -> None:
        """A collective of run ``msg.run`` failed on worker ``conn``: its island's group is
        broken for good (a host was lost, or did not reach the collective in time), so every
        later run there would fail too. The island is reset, as a stuck one is, once
        ``BROKEN_GRACE_SECONDS`` have passed without it being lost or reset otherwise
        (``check_broken_groups``). Heard only for a run in flight that the worker takes part in."""
        run = self.scheduler.running(msg.run)
        if run is None or conn.worker not in run.payload.lowered.workers or conn.island in self._broken:
            return
        self._broken[conn.island] = (self._clock() + BROKEN_GRACE_SECONDS, conn, run.id, msg.message)

    def check_broken_groups(self) -> None:
        """Reset each island whose group broke at least ``BROKEN_GRACE_SECONDS`` ago and that
        was not lost or reset since (the shell calls this every so often)."""
        now = self._clock()
        for island, (due, conn, run_id, why) in list(self._broken.items()):
            if now < due:
                continue
            del self._broken[island]
            if conn.retired or self.workers.get(conn.worker) is not conn:
                continue  # the island was lost or reset meanwhile: that error stands
            log.warning("island %s broke and is reset: %s", self.islands.by_id[island].describe(), why)
            run = self.scheduler.running(run_id)  # the hosts still in it write where they wait
            self._reset(island, f"its group broke: {why}", set(run.payload.waiting) if run else set())

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
        self._reset(island, why, set(waiting), {run.id: (STUCK, f"{why}. Island {name} was reset: its hosts "
                                                                 "restart, and its slices work again once they "
                                                                 "have joined it")})

    def _reset(self, island: int, why: str, stacks: set[int],
               failures: dict[int, tuple[str, str]] | None = None) -> None:
        """Reset island ``island`` because ``why``, as if it had lost a host: everything on it
        fails with WorkerLostError (a run in ``failures``: see ``_cut``), and its hosts are
        told to restart and join it again, those in ``stacks`` writing their threads' stacks
        to their logs first."""
        name = self.islands.by_id[island].describe()
        workers = self.membership.lose_island(island, f"it was reset: {why}")
        message = (f"island {name} was reset because {why}; arrays and computations on it are gone. Its hosts "
                   "restart and join it again, and its slices and compiled functions then work again")
        self._cut(workers, message, failures)
        for w in workers:
            conn = self.membership.remove(w)
            if conn is not None:
                conn.outbox.put(m.Reset(message, stacks=w in stacks))
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


def _stuck_host(conn: WorkerConn) -> str:
    """A host that had not finished a stuck run, as the run's error names it: with how long
    it had been silent while its host still acknowledged (slow: starved of CPU, busy or
    stopped), if it was, since that is where an operator looks first."""
    if conn.silent is None:
        return conn.describe()
    return (f"{conn.describe()}, silent for {conn.silent:.1f} s while its host still acknowledged (a process "
            "starved of CPU, busy, or stopped, e.g. by SIGSTOP or a debugger)")
