"""Islands that assemble themselves: names, sizes, ranks and coordinators. Pure: no I/O.

A worker registers with its island's name, the number of hosts the island has, and
optionally the rank it wants. The first worker to name an island sets its size; the
controller gives ranks in order of arrival (the lowest free one) unless a worker asks for
one, and refuses a registration that cannot fit (a size that disagrees, a rank out of
range or taken, an island already complete) with a message that says what to fix.

An island of several hosts is one jax.distributed group, whose coordination service rank 0
runs: every host reserves a port before it registers, and the island's coordinator is rank
0's. A host learns its rank and the coordinator in its welcome, so a host that joins before
rank 0 waits for it. Until all its hosts have joined the island is *assembling*: placement
keeps slices off it.

The controller's other parts keep integer island ids (slice requests, placement, the
scheduler): a name that is a number gets that number as its id when it is free (local
clusters name their islands 0, 1, ...), any other name the lowest free id.

An island that lost a host is *lost* until it heals: its surviving hosts restart and join
again, and so does whatever replaces the lost host (a worker started with the island's
name, by hand or by a supervisor); they assemble under the same id, and each rank gets the
worker id its former holder had, so that the slices placed there stay valid (only the
hosts' addresses change, see core.py). An island the operator retired, or one lost long
ago (the controller remembers a bounded number), is forgotten: a worker that names it later
starts a new island of that name.

The registry is the one owner of an island's health (``Health``) and of whether the
operator is retiring it (``retiring``): placement, status and the core read
``IslandRecord.health`` and ``retiring`` and nothing else; only ``join``, ``lose`` and
``healed`` change its health, and only ``set_retiring`` its retirement. Only a *healthy*
island runs anything, and only a healthy one that is not being retired takes slices
(``takes_slices``).

What brings a lost host back is the deployment's to say (``Recovery``): a local cluster that
restarts its workers, hosts started elsewhere (by hand, a scheduler), or nothing. The registry
counts the losses since an island was last healthy, and ``recovery`` says in words what is
happening to a lost or healing island, for errors and status alike.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

from pathways.protocol.messages import MAX_ISLAND, Health


class Refused(Exception):
    """A registration the controller refuses; the message says what to fix."""


class Recovery(enum.Enum):
    """Who brings a lost host back (``pathways controller --host-recovery``)."""

    RESTART = "restart"  # the local cluster that started the controller restarts its workers
    ELSEWHERE = "elsewhere"  # hosts are started by hand or by a scheduler (Slurm, Kubernetes)
    NONE = "none"  # nothing: a local cluster told not to restart its workers


@dataclass
class IslandRecord:
    """The controller's record of one island: who joined it at which rank, and its health."""

    id: int
    name: str
    hosts: int  # hosts it has once assembled
    members: dict[int, int] = field(default_factory=dict)  # rank -> worker
    coordinator: str = ""  # HOST:PORT rank 0 reserved, once rank 0 joined (islands of several hosts)
    former: dict[int, int] = field(default_factory=dict)  # rank -> worker id, kept from before a loss
    health: Health = Health.ASSEMBLING
    lost_by: Optional[str] = None  # which host was lost and how: from a loss until the island heals
    retiring: bool = False  # an operator's `pathways retire` drains it: it takes no new slices
    lost_seq: int = 0  # orders losses, so that the oldest lost islands are forgotten first
    losses: int = 0  # losses since it was last healthy: the attempt at healing under way

    @property
    def assembled(self) -> bool:
        """All its hosts have joined (a healing island may be assembled and not yet healed)."""
        return self.health is not Health.LOST and len(self.members) == self.hosts

    @property
    def assembling(self) -> bool:
        """Some of its hosts have joined and others not yet (first assembly or healing)."""
        return self.health is not Health.LOST and len(self.members) < self.hosts

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    @property
    def recovering(self) -> bool:
        """It lost a host and has not healed yet (lost, or healing)."""
        return self.health in (Health.LOST, Health.HEALING)

    def describe(self) -> str:
        return repr(self.name) if self.name == str(self.id) else f"{self.name!r} (id {self.id})"


class Islands:
    def __init__(self, recovery: Recovery = Recovery.ELSEWHERE) -> None:
        self.recovery_mode = recovery
        self.by_id: dict[int, IslandRecord] = {}
        self._named: dict[str, int] = {}  # name -> id of the island the name stands for now
        self._losses = itertools.count(1)

    def join(self, fresh: int, name: str, hosts: int, rank: Optional[int], coordinator: str,
             who: str = "") -> tuple[IslandRecord, int, int, list[tuple[int, int]]]:
        """Place a worker in island ``name`` of ``hosts`` hosts, at ``rank`` (None: the
        lowest free one), as worker ``fresh``, or as the worker that held the rank before
        the island was lost. Returns the island, the worker id, the rank, and the (worker,
        rank) pairs to welcome now: everyone once rank 0 (whose coordinator they need) has
        joined. Raises Refused. ``who`` describes the worker in messages (host, pid)."""
        this = f"the worker{who}"
        if not name.strip():
            raise Refused(f"{this} names no island; start it with --island NAME")
        island = self._island(name, hosts)
        if hosts != island.hosts:
            raise Refused(f"{this} says island {name!r} has {hosts} host(s) (--island-hosts), but "
                          f"the hosts that joined it first said {island.hosts}; start every host of an island "
                          "with the same --island-hosts")
        if rank is not None and not 0 <= rank < hosts:
            raise Refused(f"{this} asks for rank {rank} (--rank) in island {name!r} of {hosts} "
                          f"host(s); ranks run from 0 to {hosts - 1}")
        if hosts > 1 and not coordinator:
            raise Refused(f"{this} joins island {name!r} of {hosts} hosts without reserving a "
                          "coordinator port; run the same pathways version on the controller and every worker")
        if len(island.members) >= hosts:
            raise Refused(f"island {name!r} already has all its {hosts} host(s) (workers "
                          f"{sorted(island.members.values())}); give this host another --island name, or "
                          "a larger --island-hosts to every host of the island")
        if rank is None:
            rank = min(r for r in range(hosts) if r not in island.members)
        elif rank in island.members:
            free = sorted(set(range(hosts)) - set(island.members))
            raise Refused(f"rank {rank} of island {name!r} is already taken by worker "
                          f"{island.members[rank]}; give each host of the island its own --rank "
                          f"(free: {free}), or leave --rank out to have ranks given in order of arrival")
        self._named[name] = island.id
        self.by_id[island.id] = island
        if island.health is Health.LOST:  # the first host of a healing island
            island.health, island.coordinator = Health.HEALING, ""
        worker = island.former.pop(rank, fresh)
        island.members[rank] = worker
        if island.health is Health.ASSEMBLING and island.assembled:
            island.health = Health.HEALTHY
        if rank == 0:
            island.coordinator = coordinator
            return island, worker, rank, [(w, r) for r, w in sorted(island.members.items())]
        return island, worker, rank, [(worker, rank)] if 0 in island.members else []

    def lose(self, island_id: int, why: str) -> None:
        """A host of the island was lost (``why``: which, and how): the island is lost
        until its hosts join again (its surviving hosts are told to restart and rejoin).
        A loss while it heals keeps the first loss's ``why``."""
        island = self.by_id.get(island_id)
        if island is not None and island.health is not Health.LOST:
            island.health = Health.LOST
            island.losses += 1
            island.lost_by = island.lost_by or why
            island.lost_seq = next(self._losses)
            island.former.update(island.members)
            island.members.clear()
            island.coordinator = ""

    def healed(self, island_id: int) -> None:
        """Every host of a healing island joined again and the core made its slices follow
        them: the island is healthy."""
        island = self.by_id[island_id]
        island.health, island.lost_by, island.losses = Health.HEALTHY, None, 0

    def recovery(self, island: IslandRecord) -> str:
        """What is happening to a lost or healing island, in words: its hosts restarting
        (which attempt), waiting for hosts started elsewhere, or lost for good."""
        missing = island.hosts - len(island.members)
        if self.recovery_mode is Recovery.RESTART:
            return f"restarting (attempt {max(1, island.losses)}): {missing} of its {island.hosts} host(s) to join"
        if self.recovery_mode is Recovery.ELSEWHERE:
            return (f"waiting for {missing} host(s) started elsewhere to join (`pathways worker --island "
                    f"{island.name} --island-hosts {island.hosts} ...`)")
        return (f"lost, not restarted: {missing} of its {island.hosts} host(s) gone and this cluster restarts no "
                "workers; start a replacement by hand (`pathways up` prints the command) or run the cluster with "
                "worker restarts on (the default)")

    def set_retiring(self, island_id: int, retiring: bool) -> None:
        """The operator began retiring the island (it drains, then is forgotten), or gave
        up before it was: it takes slices again once healthy."""
        island = self.by_id.get(island_id)
        if island is not None:
            island.retiring = retiring

    def forget(self, island_id: int) -> None:
        """The island was retired, or lost long ago: it is no more, and its name (and id) may
        be taken by a new island."""
        island = self.by_id.pop(island_id, None)
        if island is not None and self._named.get(island.name) == island_id:
            del self._named[island.name]

    def find(self, name: str) -> Optional[IslandRecord]:
        """The island ``name`` stands for now, if any."""
        current = self._named.get(name)
        return self.by_id.get(current) if current is not None else None

    def long_lost(self, keep: int) -> list[int]:
        """The lost islands no host has joined again, and no operator is retiring, beyond the
        ``keep`` lost most recently: the oldest loss first."""
        lost = sorted((i for i in self.by_id.values() if i.health is Health.LOST and not i.retiring),
                      key=lambda i: i.lost_seq)
        return [i.id for i in lost[:max(0, len(lost) - keep)]]

    def healthy(self, island_id: int) -> bool:
        """Whether the island runs now (``takes_slices``: whether it also takes new slices)."""
        island = self.by_id.get(island_id)
        return island is not None and island.healthy

    def takes_slices(self, island_id: int) -> bool:
        """Whether placement may put new slices on the island now: healthy, not being retired."""
        island = self.by_id.get(island_id)
        return island is not None and island.healthy and not island.retiring

    def unhealthy(self) -> dict[Health, list[int]]:
        """The ids of the islands that are not healthy, by health (for explanations)."""
        states: dict[Health, list[int]] = {}
        for i, island in sorted(self.by_id.items()):
            if not island.healthy:
                states.setdefault(island.health, []).append(i)
        return states

    def _island(self, name: str, hosts: int) -> IslandRecord:
        """The island ``name`` stands for now, or a new one (not recorded until a host joins)."""
        current = self._named.get(name)
        if current is not None:
            return self.by_id[current]
        return IslandRecord(self._free_id(name), name, hosts)

    def _free_id(self, name: str) -> int:
        if name.isdecimal() and str(int(name)) == name and int(name) <= MAX_ISLAND and int(name) not in self.by_id:
            return int(name)
        return next(i for i in range(len(self.by_id) + 1) if i not in self.by_id)
