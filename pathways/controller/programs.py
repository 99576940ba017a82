"""One session's compiled functions and programs, and the cache of their lowerings.

A program is lowered once per combination of input locations (lowering.py is pure); runs
of the same program on arrays in the same places reuse it, and the worker keeps the op
stream it was sent under the lowering's key. No I/O.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from pathways.controller.lowering import FnLayouts, Lowered, lower
from pathways.controller.handles import HandleTable
from pathways.errors import PathwaysError, WireError
from pathways.ir import Layout, ProgramGraph
from pathways.protocol.messages import Compile
from pathways.protocol.errors import LOST, REMOTE

log = logging.getLogger("pathways.controller")

_keys = itertools.count(1)  # lowering keys, unique across sessions: workers cache by key


class RunFailure(PathwaysError):
    """A run cannot be dispatched; its outputs are poisoned with this message."""

    def __init__(self, message: str, kind: str = REMOTE) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class XlaCompile:
    """An "xla" function whose executable is being compiled: where, and who reports it."""

    name: str
    workers: tuple[int, ...]  # the hosts of its devices, in island-rank order
    reporter: int  # the worker hosting its first device, which sends Compiled
    devices: tuple[tuple[int, int], ...]


@dataclass
class SessionPrograms:
    fns: dict[int, FnLayouts] = field(default_factory=dict)
    compiling: dict[int, XlaCompile] = field(default_factory=dict)  # "xla" functions not compiled yet
    failed: dict[int, str] = field(default_factory=dict)  # "xla" functions that did not compile: why
    compiles: dict[int, Compile] = field(default_factory=dict)  # what was sent: sent again where hosts restart
    slice_of: dict[int, int] = field(default_factory=dict)  # function -> the slice it was compiled for
    graphs: dict[int, ProgramGraph] = field(default_factory=dict)
    sequential: set[int] = field(default_factory=set)  # programs dispatched node by node
    _lowered: dict[tuple, tuple[int, Lowered]] = field(default_factory=dict)
    _retired: list[int] = field(default_factory=list)  # keys of lowerings forgotten, still defined on workers

    def define(self, program: int, graph: ProgramGraph, sequential: bool) -> None:
        self.graphs[program] = graph
        if sequential:
            self.sequential.add(program)

    @property
    def keys(self) -> list[int]:
        """Every lowering key this session's runs used (workers hold their op streams)."""
        return [*self._retired, *(key for key, _ in self._lowered.values())]

    def forget_lowerings(self) -> None:
        """Lower every program again on its next run (its functions moved to other hosts)."""
        self._retired.extend(key for key, _ in self._lowered.values())
        self._lowered.clear()

    def lowered(self, program: int, args: Mapping[int, int], handles: HandleTable,
                gone: Callable[[Iterable[int]], list[int]],
                healing: Callable[[Iterable[int]], str] = lambda workers: "their island is healing") \
            -> tuple[int, Lowered]:
        """The lowering of ``program`` for inputs ``args`` (value -> handle), and its key.
        Raises RunFailure when an input is poisoned, deleted or lost, or a worker it needs
        is ``gone`` (not attached, or not able to run yet); ``healing`` says what became of
        such workers' islands."""
        graph = self.graphs[program]
        for node in graph.nodes:
            pending = self.compiling.get(node.fn)
            if pending is not None:
                raise RunFailure(f"function {node.fn:#x} ({pending.name!r}) has not finished compiling; wait for "
                                 "its Compiled reply (the future define_xla returned) before running it")
            if node.fn in self.failed:
                raise RunFailure(f"function {node.fn:#x} did not compile: {self.failed[node.fn]}")
        layouts: dict[int, Layout] = {}
        for v, h in args.items():
            if h in handles.poisoned:
                kind, message = handles.poisoned[h]
                raise RunFailure(message, kind)
            layout = handles.live.get(h)
            if layout is None:
                raise RunFailure(f"input array {h:#x} was deleted or never created")
            missing = gone(layout.workers)
            if missing:
                raise RunFailure(f"input array {h:#x} lived on workers {list(layout.workers)}, of which {missing} "
                                 f"are gone or on an island not yet whole: {healing(missing)}. The array is lost: "
                                 "once the island has healed (`python -m pathways status` shows it healthy), make "
                                 "it again and call again", LOST)
            layouts[v] = layout
        cache_key = (program, tuple(sorted(layouts.items())))
        hit = self._lowered.get(cache_key)
        if hit is None:
            try:
                lowered = lower(graph, self.fns, layouts, program in self.sequential)
            except WireError as e:
                raise RunFailure(str(e)) from None
            except Exception as e:  # a bug must fail the run at once, not leave its outputs unresolved
                log.exception("lowering program %#x failed", program)
                raise RunFailure(f"the controller could not lower this program ({type(e).__name__}: {e}); "
                                 "this is a bug in pathways, please report it with the program") from None
            hit = self._lowered[cache_key] = (next(_keys), lowered)
        missing = gone(hit[1].ops)
        if missing:
            raise RunFailure(f"the program needs worker(s) {missing}, which are gone or on an island not yet "
                             f"whole: {healing(missing)}. Its inputs are kept; call it again once `python -m "
                             "pathways status` shows the island healthy, or compile it for a slice of a healthy "
                             "island", LOST)
        return hit
