"""Retiring islands and hosts (`pathways retire`): a part of the controller core
(ControllerCore), working on its state; and forgetting lost islands nobody rejoins, beyond
MAX_LOST_ISLANDS."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from pathways.protocol.messages import Health
from pathways.controller.membership import MAX_WORKERS
from pathways.controller.state import Retirement
from pathways.errors import PathwaysError
from pathways.protocol import messages as m
from pathways.protocol.operator import Retired

log = logging.getLogger("pathways.controller")


# Lost islands that no host has rejoined which the controller remembers (status lists them
# as unhealthy); beyond it the oldest loss is forgotten.
MAX_LOST_ISLANDS = 64


class Retiring:
    """ControllerCore's retirements of islands and hosts."""

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

    def finish_retirement(self, r: Retirement, drained: bool = False) -> Retired | None:
        """Retire what ``r`` names, whether its runs drained or not: the hosts are told to
        shut down (Shutdown: they exit, their keepers do not start them again), whatever
        still involves them fails with WorkerLostError saying the operator retired them,
        and, for a whole island, its slices are released and the island forgotten (its
        name is free for new workers). One host of a larger island is lost on purpose: the
        island heals once a host replaces it. Returns what was done, for the operator
        (``drained``: whether its runs finished first), or None for a retirement abandoned
        already."""
        if self._retirements.pop(r.id, None) is None:
            return None
        island = r.island
        report: dict[str, Any] = {"island": island.name, "id": island.id, "worker": None, "hosts": [],
                                  "runs_cut": self.scheduler.queued(island.id) + self.scheduler.inflight(island.id),
                                  "slices_released": 0, "sessions": [], "was": island.health.value}
        if self.islands.by_id.get(island.id) is not island:  # forgotten meanwhile, as a lost island
            report["was"] = "forgotten"
            return _retired(report, drained)
        self.islands.set_retiring(island.id, False)
        if r.host is not None:
            conn = r.host
            report["worker"] = conn.worker
            if self.workers.get(conn.worker) is not conn:
                report["was"] = "lost"  # it went away while its island drained: nothing left to shut down
                return _retired(report, drained)
            report["hosts"] = [conn.worker]
            report["sessions"] = self._owners(island.id)
            conn.outbox.put(m.Shutdown(f"this host was retired by the operator (`pathways retire --worker "
                                       f"{conn.worker}`)"))
            self._lose_host(conn, f"it was retired by the operator (`pathways retire --worker {conn.worker}`)")
            return _retired(report, drained)
        name = island.describe()
        message = (f"island {name} was retired by the operator (`pathways retire`): "
                   + ("it had lost a host, and is forgotten" if island.health is Health.LOST
                      else "its hosts were shut down")
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
        return _retired(report, drained)

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


def _retired(report: dict[str, Any], drained: bool) -> Retired:
    return Retired(**{**report, "hosts": tuple(report["hosts"]), "sessions": tuple(report["sessions"])},
                   drained=drained)
