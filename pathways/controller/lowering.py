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
from pathways.ir import Layout, Node, ProgramGraph
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
    return _Lowering(graph, fns, input_layouts, sequential).lowered()


class _Lowering:
    """The state of one ``lower``: each worker's ops so far, where each value (and each copy
    of it in another layout) lives, and the transfers that make the copies."""

    def __init__(self, graph: ProgramGraph, fns: Mapping[int, FnLayouts], input_layouts: Mapping[int, Layout],
                 sequential: bool) -> None:
        self.graph, self.fns, self.sequential = graph, fns, sequential
        self.ops: dict[int, list[list]] = defaultdict(list)
        self.home: dict[int, Layout] = {}
        self.copy_of: dict[tuple[int, Layout], int] = {}
        self.in_store: set[int] = set()  # values that reach a worker through the object store
        self.loaded: set[tuple[int, int]] = set()
        self.outputs = set(graph.outputs)
        self.transfers: list[tuple[int, int, int]] = []
        self.senders_to: dict[tuple[int, int], list[int]] = {}  # (copy, receiver) -> the workers pushing it there
        self.next_copy = graph.nvalues
        self.producer: dict[int, int] = {}  # value -> index of the node computing it
        self.preds: dict[int, tuple[int, ...]] = {}
        self.steps: dict[int, tuple[int, ...]] = {}
        self.waits: dict[int, list[int]] = defaultdict(list)
        self.node_index = -1
        for v in graph.inputs:
            if v not in input_layouts:
                raise WireError(f"program input {v} has no location")
            self.home[v] = input_layouts[v]
            self.copy_of[(v, self.home[v])] = v
            self.in_store.add(v)

    def lowered(self) -> Lowered:
        for self.node_index, node in enumerate(self.graph.nodes):
            self._node(node)
        gates = None
        if self.sequential:
            succs: dict[int, list[int]] = defaultdict(list)
            for n, ps in self.preds.items():
                for p in ps:
                    succs[p].append(n)
            gates = Gates(self.preds, {n: tuple(ss) for n, ss in succs.items()}, self.steps,
                          {n: tuple(ws) for n, ws in self.waits.items()})
        return Lowered({w: _with_drops(stream) for w, stream in self.ops.items()},
                       self.next_copy - self.graph.nvalues, {v: self.home[v] for v in self.outputs},
                       tuple(self.transfers), gates)

    def _emit(self, worker: int, op: list) -> None:
        n = self.node_index
        if self.sequential and self.preds[n] and worker not in self.waits[n]:
            self.waits[n].append(worker)
            self.ops[worker].append([Op.AWAIT, n])
        self.ops[worker].append(op)

    def _load(self, worker: int, v: int) -> None:
        if v in self.in_store and (worker, v) not in self.loaded:
            # a copy names its senders: its receiver takes it from them only (an input: none)
            self._emit(worker, [Op.IN, v, self.senders_to.get((v, worker), [])])
            self.loaded.add((worker, v))

    def _materialize(self, v: int, want: Layout) -> int:
        """The value (``v`` or a copy of it) holding ``v`` in layout ``want``."""
        if (v, want) in self.copy_of:
            return self.copy_of[(v, want)]
        src_layout = self.home[v]
        if src_layout.unreduced or want.unreduced:
            # a move copies a block from any device holding it, which is right for
            # replicas only: partial values would be dropped or counted again
            raise WireError(f"value {v} would move from a layout with unreduced axes {list(src_layout.unreduced)} "
                            f"to one with {list(want.unreduced)}, which would lose or repeat its partial values; "
                            "reduce it first (jax.sharding.reshard to a sharding without unreduced axes), or "
                            "use it on the devices and sharding that hold it")
        src = self.copy_of[(v, src_layout)]
        dst = self.next_copy
        self.next_copy += 1
        if src_layout.workers == want.workers and not want.multi_host:
            self._load(want.workers[0], src)
            self._emit(want.workers[0], [Op.RESHARD, src, dst, want.to_wire()])
        else:
            self._send(v, src, dst, src_layout, want)
        self.copy_of[(v, want)] = dst
        return dst

    def _send(self, v: int, src: int, dst: int, src_layout: Layout, want: Layout) -> None:
        """Copy ``dst`` of value ``v`` in layout ``want``, sent from ``src`` by the workers
        holding the blocks each receiver needs."""
        routes = plan(self.graph.shape(v), src_layout, want)
        senders_of: dict[int, int] = defaultdict(int)
        for route in routes:
            senders_of[route.receiver] += 1
        by_sender: dict[int, list] = defaultdict(list)
        for route in routes:
            by_sender[route.sender].append(
                [route.receiver, senders_of[route.receiver],
                 [[x for bounds in region for x in bounds] for region in route.regions]])
            self.transfers.append((route.sender, route.receiver, dst))
            self.senders_to.setdefault((dst, route.receiver), []).append(route.sender)
        for sender, sends in by_sender.items():
            self._load(sender, src)
            self._emit(sender, [Op.SEND, src, dst, want.to_wire(), sends])
        self.in_store.add(dst)

    def _node(self, node: Node) -> None:
        fn = self.fns.get(node.fn)
        if fn is None:
            raise WireError(f"program calls unknown compiled function {node.fn}")
        if len(fn.ins) != len(node.ins) or len(fn.outs) != len(node.outs):
            raise WireError(
                f"node of function {node.fn} has {len(node.ins)} inputs and {len(node.outs)} "
                f"outputs; the function takes {len(fn.ins)} and returns {len(fn.outs)}")
        n = self.node_index
        self.preds[n] = tuple(sorted({self.producer[v] for v in node.ins if v in self.producer}))
        args = [self._materialize(v, layout) for v, layout in zip(node.ins, fn.ins)]
        for w in fn.workers:
            for a in args:
                self._load(w, a)
            self._emit(w, [Op.EXEC, node.fn, args, list(node.outs)])
            if self.sequential:
                self._emit(w, [Op.STEP, n, list(node.outs)])
        self.steps[n] = fn.workers
        for v, layout in zip(node.outs, fn.outs):
            self.producer[v] = n
            self.home[v] = layout
            self.copy_of[(v, layout)] = v
            if v in self.outputs:
                for w in fn.workers:
                    self._emit(w, [Op.OUT, v])


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
