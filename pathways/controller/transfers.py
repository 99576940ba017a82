"""Which bytes of an array go from which host to which host when it changes layout. Pure.

A layout cuts an array into blocks, one per device (``NamedSharding`` semantics: a
dimension sharded over mesh axes (a, b) has size(a) * size(b) blocks, a major). Each
receiving host needs the distinct blocks of its own devices, and no more; each of those
bytes comes from exactly one sending host that holds it, preferably the receiver itself
(a local copy, not a network transfer), otherwise the holder with the fewest bytes
assigned so far, so that replicated sources share the sending.
"""

from __future__ import annotations

from dataclasses import dataclass

from pathways.ir import Layout, host_regions
from pathways.wire.codec import Region
from pathways.wire.codec import intersect, volume


@dataclass(frozen=True)
class Route:
    """What one sender pushes to one receiver: the regions, in global coordinates."""

    sender: int
    receiver: int
    regions: tuple[Region, ...]


def plan(shape: tuple[int, ...], src: Layout, dst: Layout) -> list[Route]:
    """The routes that give every host of ``dst`` exactly the blocks it needs of an array
    of ``shape`` laid out as ``src``, each byte sent once."""
    sources = host_regions(shape, src)
    holders: dict[Region, list[int]] = {}
    for worker, regions in sources.items():
        for region in regions:
            holders.setdefault(region, []).append(worker)
    assigned = dict.fromkeys(src.workers, 0)
    routes: dict[tuple[int, int], list[Region]] = {}
    for receiver, needed in host_regions(shape, dst).items():
        for want in needed:
            for block, owners in holders.items():
                piece = intersect(want, block)
                if piece is None:
                    continue
                sender = receiver if receiver in owners else min(owners, key=lambda w: (assigned[w], w))
                assigned[sender] += volume(piece)
                routes.setdefault((sender, receiver), []).append(piece)
    return [Route(s, r, tuple(regions)) for (s, r), regions in routes.items()]
