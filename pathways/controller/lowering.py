"""Lowering a program graph to one op stream per worker. Pure: no I/O, no JAX.

A value on a multi-host slice has one part on each of its hosts, so an op touching it
appears in the stream of every one of them. The worker executes its stream in order with a
register file indexed by value number (worker/executor.py). The ops are protocol/ops.py's
``Op`` vocabulary, emitted as wire lists ``[Op.X, field, ...]``; sequential dispatch adds
``AWAIT`` and ``STEP`` gates on the controller.

Values numbered at or above the graph's ``nvalues`` are transfer copies created here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from pathways.controller.transfers import plan
from pathways.errors import WireError
from pathways.ir import Layout, ProgramGraph
from pathways.protocol.ops import Op


@dataclass(frozen=True)
class FnLayouts:
    """Where a compiled function runs and the layouts of its flat inputs and outputs."""

    workers: tuple[int, ...]
    ins: tuple[Layout, ...]
    outs: tuple[Layout, ...]


@dataclass(frozen=True)
class Gates:
    """How a sequentially dispatched program is released node by node."""

    preds: dict[int, tuple[int, ...]]  # node -> the nodes it reads from
    succs: dict[int, tuple[int, ...]]  # node -> the nodes that read from it
    steps: dict[int, tuple[int, ...]]  # node -> the workers that report it finished
    waits: dict[int, tuple[int, ...]]  # node -> the workers that wait for its release


@dataclass(frozen=True)
class Lowered:
    ops: dict[int, list[list]]  # worker -> op stream
    ncopies: int  # transfer copies numbered nvalues .. nvalues+ncopies-1
    output_layouts: dict[int, Layout]  # program output value -> where it lives
    transfers: tuple[tuple[int, int, int], ...]  # (sender, receiver, copy value) per push
    gates: Gates | None = None  # set for sequential dispatch

    @property
    def workers(self) -> frozenset[int]:
        return frozenset(self.ops)


def lower(graph: ProgramGraph, fns: Mapping[int, FnLayouts], input_layouts: Mapping[int, Layout],
          sequential: bool = False) -> Lowered:
    """Lower ``graph`` given where its inputs live.

    Inputs belong to the caller and stay in the store; transfer copies exist for this run
    only and are removed from the store as they are loaded. ``sequential`` adds the gates
    of sequential dispatch.
    """
    ops: dict[int, list[list]] = defaultdict(list)
    home: dict[int, Layout] = {}
    copy_of: dict[tuple[int, Layout], int] = {}
    in_store: set[int] = set()  # values that reach a worker through the object store
    loaded: set[tuple[int, int]] = set()
    outputs = set(graph.outputs)
    transfers: list[tuple[int, int, int]] = []
    senders_to: dict[tuple[int, int], list[int]] = {}  # (copy, receiver) -> the workers pushing it there
    next_copy = graph.nvalues
    producer: dict[int, int] = {}  # value -> index of the node computing it
    preds: dict[int, tuple[int, ...]] = {}
    steps: dict[int, tuple[int, ...]] = {}
    waits: dict[int, list[int]] = defaultdict(list)
    node_index = -1

    def emit(worker: int, op: list) -> None:
        if sequential and preds[node_index] and worker not in waits[node_index]:
            waits[node_index].append(worker)
            ops[worker].append([Op.AWAIT, node_index])
        ops[worker].append(op)

    for v in graph.inputs:
        if v not in input_layouts:
            raise WireError(f"program input {v} has no location")
        home[v] = input_layouts[v]
        copy_of[(v, home[v])] = v
        in_store.add(v)

    def load(worker: int, v: int) -> None:
        if v in in_store and (worker, v) not in loaded:
            # a copy names its senders: its receiver takes it from them only (an input: none)
            emit(worker, [Op.IN, v, senders_to.get((v, worker), [])])
            loaded.add((worker, v))

    def materialize(v: int, want: Layout) -> int:
        nonlocal next_copy
        if (v, want) in copy_of:
            return copy_of[(v, want)]
        src_layout = home[v]
        if src_layout.unreduced or want.unreduced:
            # a move copies a block from any device holding it, which is right for
            # replicas only: partial values would be dropped or counted again
            raise WireError(f"value {v} would move from a layout with unreduced axes {list(src_layout.unreduced)} "
                            f"to one with {list(want.unreduced)}, which would lose or repeat its partial values; "
                            "reduce it first (jax.sharding.reshard to a sharding without unreduced axes), or "
                            "use it on the devices and sharding that hold it")
        src = copy_of[(v, src_layout)]
        dst = next_copy
        next_copy += 1
        if src_layout.workers == want.workers and not want.multi_host:
            load(want.workers[0], src)
            emit(want.workers[0], [Op.RESHARD, src, dst, want.to_wire()])
        else:
            routes = plan(graph.shape(v), src_layout, want)
            senders_of: dict[int, int] = defaultdict(int)
            for route in routes:
                senders_of[route.receiver] += 1
            by_sender: dict[int, list] = defaultdict(list)
            for route in routes:
                by_sender[route.sender].append(
                    [route.receiver, senders_of[route.receiver],
                     [[x for bounds in region for x in bounds] for region in route.regions]])
                transfers.append((route.sender, route.receiver, dst))
                senders_to.setdefault((dst, route.receiver), []).append(route.sender)
            for sender, sends in by_sender.items():
                load(sender, src)
                emit(sender, [Op.SEND, src, dst, want.to_wire(), sends])
            in_store.add(dst)
        copy_of[(v, want)] = dst
        return dst

    for node_index, node in enumerate(graph.nodes):
        fn = fns.get(node.fn)
        if fn is None:
            raise WireError(f"program calls unknown compiled function {node.fn}")
        if len(fn.ins) != len(node.ins) or len(fn.outs) != len(node.outs):
            raise WireError(
                f"node of function {node.fn} has {len(node.ins)} inputs and {len(node.outs)} "
                f"outputs; the function takes {len(fn.ins)} and returns {len(fn.outs)}")
        preds[node_index] = tuple(sorted({producer[v] for v in node.ins if v in producer}))
        args = [materialize(v, layout) for v, layout in zip(node.ins, fn.ins)]
        for w in fn.workers:
            for a in args:
                load(w, a)
            emit(w, [Op.EXEC, node.fn, args, list(node.outs)])
            if sequential:
                emit(w, [Op.STEP, node_index, list(node.outs)])
        steps[node_index] = fn.workers
        for v, layout in zip(node.outs, fn.outs):
            producer[v] = node_index
            home[v] = layout
            copy_of[(v, layout)] = v
            if v in outputs:
                for w in fn.workers:
                    emit(w, [Op.OUT, v])

    gates = None
    if sequential:
        succs: dict[int, list[int]] = defaultdict(list)
        for n, ps in preds.items():
            for p in ps:
                succs[p].append(n)
        gates = Gates(preds, {n: tuple(ss) for n, ss in succs.items()}, steps,
                      {n: tuple(ws) for n, ws in waits.items()})
    return Lowered({w: _with_drops(stream) for w, stream in ops.items()},
                   next_copy - graph.nvalues, {v: home[v] for v in outputs}, tuple(transfers), gates)


def _reads(op: list) -> list[int]:
    code = op[0]
    if code is Op.EXEC:
        return op[2]
    if code in (Op.SEND, Op.RESHARD, Op.OUT):
        return [op[1]]
    if code is Op.STEP:
        return op[2]
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
            out.append([Op.DROP, sorted(drops[i])])
    return out
