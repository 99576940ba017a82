"""Lowering a program graph to one op stream per worker. Pure: no I/O, no JAX.

A value on a multi-host slice has one part on each of its hosts, so an op touching it
appears in the stream of every one of them. The worker executes its stream in order with a
register file indexed by value number (worker/executor.py). Ops, as wire lists:

- ``["in", v, keep]``: wait for handle(v) in the object store, load it into register v;
  with keep false the store entry is removed (a transfer copy for this run only).
- ``["exec", fn, ins, outs]``: run compiled function ``fn``.
- ``["out", v]``: publish register v to the object store as handle(v).
- ``["send", v, workers, dst, layout, nsenders]``: push this host's part of register v to
  each of ``workers``, arriving as handle(dst) in ``layout``; a receiver assembles the array
  once all ``nsenders`` hosts of the source have sent their parts.
- ``["reshard", v, dst, layout]``: copy register v into ``layout`` on this worker.
- ``["drop", [v...]]``: release registers after their last use.

Values numbered at or above the graph's ``nvalues`` are transfer copies created here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from pathways.errors import WireError
from pathways.ir import Layout, ProgramGraph


@dataclass(frozen=True)
class FnLayouts:
    """Where a compiled function runs and the layouts of its flat inputs and outputs."""

    workers: tuple[int, ...]
    ins: tuple[Layout, ...]
    outs: tuple[Layout, ...]


@dataclass(frozen=True)
class Lowered:
    ops: dict[int, list[list]]  # worker -> op stream
    ncopies: int  # transfer copies numbered nvalues .. nvalues+ncopies-1
    output_layouts: dict[int, Layout]  # program output value -> where it lives
    transfers: tuple[tuple[int, int, int], ...]  # (sender, receiver, copy value) per push

    @property
    def workers(self) -> frozenset[int]:
        return frozenset(self.ops)


def lower(graph: ProgramGraph, fns: Mapping[int, FnLayouts], input_layouts: Mapping[int, Layout]) -> Lowered:
    """Lower ``graph`` given where its inputs live.

    Inputs belong to the caller and stay in the store; transfer copies exist for this run
    only and are removed from the store as they are loaded.
    """
    ops: dict[int, list[list]] = defaultdict(list)
    home: dict[int, Layout] = {}
    copy_of: dict[tuple[int, Layout], int] = {}
    in_store: set[int] = set()  # values that reach a worker through the object store
    loaded: set[tuple[int, int]] = set()
    outputs = set(graph.outputs)
    transfers: list[tuple[int, int, int]] = []
    next_copy = graph.nvalues

    for v in graph.inputs:
        if v not in input_layouts:
            raise WireError(f"program input {v} has no location")
        home[v] = input_layouts[v]
        copy_of[(v, home[v])] = v
        in_store.add(v)

    def load(worker: int, v: int) -> None:
        if v in in_store and (worker, v) not in loaded:
            ops[worker].append(["in", v, v < graph.nvalues])
            loaded.add((worker, v))

    def materialize(v: int, want: Layout) -> int:
        nonlocal next_copy
        if (v, want) in copy_of:
            return copy_of[(v, want)]
        src_layout = home[v]
        src = copy_of[(v, src_layout)]
        dst = next_copy
        next_copy += 1
        for w in src_layout.workers:
            load(w, src)
        if src_layout.workers == want.workers and not want.multi_host:
            ops[want.workers[0]].append(["reshard", src, dst, want.to_wire()])
        else:
            for w in src_layout.workers:
                ops[w].append(["send", src, list(want.workers), dst, want.to_wire(), len(src_layout.workers)])
                transfers.extend((w, r, dst) for r in want.workers)
            in_store.add(dst)
        copy_of[(v, want)] = dst
        return dst

    for node in graph.nodes:
        fn = fns.get(node.fn)
        if fn is None:
            raise WireError(f"program calls unknown compiled function {node.fn}")
        if len(fn.ins) != len(node.ins) or len(fn.outs) != len(node.outs):
            raise WireError(
                f"node of function {node.fn} has {len(node.ins)} inputs and {len(node.outs)} "
                f"outputs; the function takes {len(fn.ins)} and returns {len(fn.outs)}")
        args = [materialize(v, layout) for v, layout in zip(node.ins, fn.ins)]
        for w in fn.workers:
            for a in args:
                load(w, a)
            ops[w].append(["exec", node.fn, args, list(node.outs)])
        for v, layout in zip(node.outs, fn.outs):
            home[v] = layout
            copy_of[(v, layout)] = v
            if v in outputs:
                for w in fn.workers:
                    ops[w].append(["out", v])

    return Lowered({w: _with_drops(stream) for w, stream in ops.items()},
                   next_copy - graph.nvalues, {v: home[v] for v in outputs}, tuple(transfers))


def _reads(op: list) -> list[int]:
    kind = op[0]
    if kind == "exec":
        return op[2]
    if kind in ("send", "reshard", "out"):
        return [op[1]]
    return []


def _with_drops(stream: list[list]) -> list[list]:
    """Insert a ``drop`` after the op that reads each register for the last time."""
    last_read: dict[int, int] = {}
    for i, op in enumerate(stream):
        for v in _reads(op):
            last_read[v] = i
    drops: dict[int, list[int]] = defaultdict(list)
    for v, i in last_read.items():
        drops[i].append(v)
    out: list[list] = []
    for i, op in enumerate(stream):
        out.append(op)
        if i in drops:
            out.append(["drop", sorted(drops[i])])
    return out
