"""Suspend and resume of one session: its state while suspending, suspended and resuming,
and the remap of everything that names its old devices onto the new ones. Pure: no I/O.

Suspending drains the session (no new runs; those queued and in flight finish), has every
worker holding its arrays move them off the devices (Offload; each answers with the shapes
it moved, Offloaded), then releases its slices, keeping their old placements. Resuming
places each slice again (anywhere it fits: other hosts, another island), remaps every
layout that named the old devices (arrays, functions, what was sent to compile them), and
moves the arrays from the hosts that offloaded them to the new ones (Restore and Adopt,
planned like any transfer by transfers.plan); the session runs again once every receiver
has its arrays (Adopted). A suspended session queues no runs, so the fair-share scheduler
gives it no share: its weight counts again from the first run after it resumes.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from pathways.controller.lowering import FnLayouts
from pathways.controller.placement import SlicePlacement
from pathways.ir import Layout
from pathways.protocol.messages import (DRAINING, OFFLOADING, RESUMING, SUSPENDED, Compile, device_pairs,
                                        flat_devices)


@dataclass
class Suspension:
    """A session from the Suspend request until it has resumed."""

    req: int  # the request answered when the current step ends (Suspend's, then Resume's)
    path: str
    state: str = DRAINING
    waiting: set[int] = field(default_factory=set)  # workers whose answer the current step waits for
    placements: dict[int, SlicePlacement] = field(default_factory=dict)  # slice id -> where it was
    holders: set[int] = field(default_factory=set)  # workers that offloaded arrays of the session
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # handle -> shape, as offloaded
    arrays: int = 0
    nbytes: int = 0
    warnings: list[str] = field(default_factory=list)
    # while resuming: each moved handle's copy, the old workers sending it and its receivers
    moving: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)


class Remap:
    """Old placements of a session's slices -> new ones: maps layouts, functions and their
    compile messages from the old devices to the new, position by position (a slice's
    devices are in mesh order, and it keeps its count and mesh shape)."""

    def __init__(self, moves: list[tuple[SlicePlacement, SlicePlacement]], rank: Mapping[int, int]) -> None:
        self._moves = moves
        self._rank = rank  # new hosts' worker id -> island rank
        self._exact = {(old.workers, old.devices): (old, new) for old, new in moves}
        self.slices = {old.slice_id: new for old, new in moves}

    def _move_of(self, workers: tuple[int, ...], devices: tuple) -> Optional[tuple[SlicePlacement, SlicePlacement]]:
        hit = self._exact.get((workers, devices))
        if hit is None:  # a layout on part of a slice (an "xla" function's)
            hit = next(((old, new) for old, new in self._moves
                        if set(workers) <= set(old.workers) and set(devices) <= set(old.devices)), None)
        return hit

    def devices(self, workers: tuple[int, ...], devices: tuple) -> Optional[tuple[tuple[int, ...], tuple]]:
        """The new (workers, devices) of devices that were on ``workers``; None if they
        were on no slice of the session."""
        hit = self._move_of(workers, devices)
        if hit is None:
            return None
        old, new = hit
        where = dict(zip(old.devices, new.devices))
        moved = tuple(where[d] for d in devices)
        ranks = {r for r, _ in moved}
        return tuple(w for w in new.workers if self._rank[w] in ranks), moved

    def layout(self, layout: Layout) -> Optional[Layout]:
        moved = self.devices(layout.workers, layout.devices)
        if moved is None:
            return None
        return dataclasses.replace(layout, workers=moved[0], devices=moved[1])

    def _layouts(self, layouts: tuple[Layout, ...]) -> tuple[Layout, ...]:
        out = tuple(self.layout(x) for x in layouts)
        if any(x is None for x in out):
            raise ValueError("a function's layout is on no slice of its session")
        return out  # type: ignore[return-value]

    def function(self, fn: FnLayouts, slice_id: int) -> FnLayouts:
        ins, outs = self._layouts(fn.ins), self._layouts(fn.outs)
        workers = {w for x in (*ins, *outs) for w in x.workers}
        new = self.slices[slice_id]
        return FnLayouts(tuple(w for w in new.workers if w in workers) or new.workers, ins, outs)

    def compile(self, msg: Compile, slice_id: int) -> Compile:
        """What the new hosts are sent to compile the function that ``msg`` compiled."""
        new = self.slices[slice_id]
        body = msg.body
        if body.format == "xla":
            moved = self.devices(msg.workers, device_pairs(body.devices))
            if moved is None:
                raise ValueError(f"function {body.name!r} was compiled on devices of no slice of its session")
            workers, devices = moved
            return Compile(msg.fn, replace(body, devices=flat_devices(devices)), workers)
        ins, outs = self._layouts(body.ins), self._layouts(body.outs)
        ranks = {r for x in (*ins, *outs) for r, _ in x.devices}
        workers = tuple(w for w in new.workers if self._rank[w] in ranks) or new.workers
        return Compile(msg.fn, replace(body, ins=ins, outs=outs), workers)
