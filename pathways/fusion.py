"""Program-level fusion: which nodes of a program graph can run as one executable.

Pure: graph in, groups and graph out; no JAX, no I/O. The client compiles each group of
more than one node into one function (client/fusion.py) and registers the graph that
:func:`fused` returns, with one node per group.

Two nodes join along a value when the value is private: computed by a node of the same
fusion key (same slice and mesh) as every node that reads it, and not a program output.
A group must also stay convex: no path may leave it through another node and come back
(fusing across one would make the group wait for itself).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from pathways.ir import Node, ProgramGraph


@dataclass(frozen=True)
class Group:
    """Nodes that run as one computation."""

    nodes: tuple[int, ...]  # indices into the graph's nodes, in trace order
    ins: tuple[int, ...]  # values read and not computed here, in order of first read
    outs: tuple[int, ...]  # values computed here that a node outside or the program's result reads


def groups(graph: ProgramGraph, keys: Mapping[int, Hashable]) -> list[Group]:
    """Every node of ``graph`` in exactly one group, groups ordered by their first node.

    ``keys`` maps each compiled function of the graph to its fusion key: only nodes whose
    functions have equal keys (the same slice and mesh) share a group.
    """
    nodes = graph.nodes
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for v in node.ins:
            readers.setdefault(v, []).append(i)
        for v in node.outs:
            producer[v] = i
    outputs = set(graph.outputs)

    def private(v: int) -> bool:
        if v in outputs or v not in producer:
            return False
        key = keys[nodes[producer[v]].fn]
        return all(keys[nodes[r].fn] == key for r in readers[v])

    # Bit masks over node indices: ancestors of each node; members and ancestors of each group.
    anc: list[int] = []
    members: list[list[int]] = []
    mask: list[int] = []
    group_anc: list[int] = []
    group_of: list[int] = []

    def convex(joined: int, ancestors: int) -> bool:
        outside = ancestors & ~joined
        while outside:
            low = outside & -outside
            if anc[low.bit_length() - 1] & joined:  # a path out of the group and back in
                return False
            outside ^= low
        return True

    for i, node in enumerate(nodes):
        a = 0
        for v in node.ins:
            if v in producer:
                a |= anc[producer[v]] | (1 << producer[v])
        anc.append(a)
        candidates = list(dict.fromkeys(group_of[producer[v]] for v in node.ins if private(v)))
        # Join every group it reads a private value from when that stays convex, else the
        # first one that does, else start a group.
        options = [candidates] + ([[g] for g in candidates] if len(candidates) > 1 else [])
        chosen: list[int] = []
        for option in options:
            joined, ancestors = 1 << i, a
            for g in option:
                joined |= mask[g]
                ancestors |= group_anc[g]
            if option and convex(joined, ancestors):
                chosen = option
                break
        if not chosen:
            group_of.append(len(members))
            members.append([i])
            mask.append(1 << i)
            group_anc.append(a)
            continue
        target, *rest = sorted(chosen)
        for g in rest:
            for j in members[g]:
                group_of[j] = target
            members[target].extend(members[g])
            mask[target] |= mask[g]
            group_anc[target] |= group_anc[g]
            members[g], mask[g], group_anc[g] = [], 0, 0
        group_of.append(target)
        members[target].append(i)
        mask[target] |= 1 << i
        group_anc[target] |= a
    return _described(graph, members, group_of, readers)


def _described(graph: ProgramGraph, members: list[list[int]], group_of: list[int],
               readers: dict[int, list[int]]) -> list[Group]:
    """The groups whose nodes ``members`` lists (some lists emptied by merges), each with the
    values it reads from outside and those it computes for the outside, ordered by their
    first node."""
    out, outputs = [], set(graph.outputs)
    for g, ms in enumerate(members):
        if not ms:
            continue
        ms.sort()
        computed = {v for j in ms for v in graph.nodes[j].outs}
        ins = dict.fromkeys(v for j in ms for v in graph.nodes[j].ins if v not in computed)
        outs = tuple(v for j in ms for v in graph.nodes[j].outs
                     if v in outputs or any(group_of[r] != g for r in readers.get(v, ())))
        out.append(Group(tuple(ms), tuple(ins), outs))
    out.sort(key=lambda grp: grp.nodes[0])
    return out


def fused(graph: ProgramGraph, grouped: Sequence[Group], fns: Sequence[int]) -> ProgramGraph:
    """``graph`` with one node per group: ``fns[k]`` is the function computing group ``k``
    from its ``ins`` to its ``outs`` (a group of one node keeps its node as it is).

    The nodes are in an order that respects the data flow, as close to trace order as it
    allows; values only read inside a group are no longer defined by any node.
    """
    if len(fns) != len(grouped):
        raise ValueError(f"fused needs one function per group: {len(grouped)} groups, {len(fns)} functions")
    made: dict[int, int] = {}
    for k, grp in enumerate(grouped):
        for v in grp.outs:
            made[v] = k
    after: list[set[int]] = [set() for _ in grouped]  # group -> the groups it reads from
    for k, grp in enumerate(grouped):
        after[k] = {made[v] for v in grp.ins if v in made}
    waiting = [len(a) for a in after]
    readers_of: list[list[int]] = [[] for _ in grouped]
    for k, a in enumerate(after):
        for p in a:
            readers_of[p].append(k)
    ready = [(grp.nodes[0], k) for k, grp in enumerate(grouped) if not waiting[k]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for r in readers_of[k]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, (grouped[r].nodes[0], r))
    if len(order) != len(grouped):
        raise ValueError("the groups depend on each other in a cycle; groups() never makes such groups")
    nodes = []
    for k in order:
        grp = grouped[k]
        if len(grp.nodes) == 1:
            nodes.append(graph.nodes[grp.nodes[0]])
        else:
            nodes.append(Node(fns[k], grp.ins, grp.outs))
    out = ProgramGraph(graph.nvalues, graph.inputs, tuple(nodes), graph.outputs, graph.types)
    out.check()
    return out
