"""Compiling a fused program (``pw.program(fun, fuse=True)``).

pathways/fusion.py decides which nodes share an executable; here each group of more than
one node becomes one exported function that calls the nodes' own jitted functions in
trace order, with the layouts the nodes had at the group's edges: the same operations on
the same shards, so the results are those of the unfused program.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import jax
from jax.sharding import NamedSharding as JaxNamedSharding

from pathways import fusion
from pathways.client.compiled import Aval, Specialization, abstract_mesh, define_function
from pathways.errors import ProgramTraceError
from pathways.ir import ProgramGraph
from pathways.platforms import export_platforms


def fuse_graph(session: Any, graph: ProgramGraph, specs: Mapping[int, Specialization],
               avals: Mapping[int, Aval], program: str) -> tuple[ProgramGraph, dict[int, str]]:
    """``graph`` with every fusible group of nodes replaced by one node of a new function,
    defined on the cluster, and the name of the fused node computing each value a group
    hands on. ``specs`` maps each function of the graph to its specialization and
    ``avals`` each value to its (shape, dtype); ``program`` names errors."""
    keys = {fn: (s.slice.id, s.mesh.shape, s.mesh.axis_names) for fn, s in specs.items()}
    grouped = fusion.groups(graph, keys)
    fns, origins = [], {}
    for g in grouped:
        if len(g.nodes) == 1:
            fns.append(graph.nodes[g.nodes[0]].fn)
            continue
        fn, name = _define(session, graph, g, specs, avals, program)
        fns.append(fn)
        origins.update(dict.fromkeys(g.outs, name))
    return fusion.fused(graph, grouped, fns), origins


def describe(names: list[str], limit: int = 512) -> str:
    """Function names in order, a run of one name written once with its count (``step*128,
    total``), cut to about ``limit`` characters (a wire name has a bound)."""
    text = ", ".join(name if n == 1 else f"{name}*{n}"
                     for name, n in ((k, len(list(run))) for k, run in itertools.groupby(names)))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(names)} nodes)"


def _define(session: Any, graph: ProgramGraph, group: fusion.Group, specs: Mapping[int, Specialization],
            avals: Mapping[int, Aval], program: str) -> tuple[int, str]:
    members = [graph.nodes[i] for i in group.nodes]
    first = specs[members[0].fn]
    in_shardings: dict[int, Any] = {}
    out_shardings: dict[int, Any] = {}
    for node in members:
        spec = specs[node.fn]
        for v, sharding in zip(node.ins, spec.in_shardings):
            in_shardings.setdefault(v, sharding)  # the first reader's layout; a later one reshards inside
        out_shardings.update(zip(node.outs, spec.out_shardings))
    bodies = [(specs[node.fn].body, node.ins, node.outs) for node in members]

    def run_group(*args: Any) -> list:
        env = dict(zip(group.ins, args))
        for body, ins, outs in bodies:
            env.update(zip(outs, body(*[env[v] for v in ins])))
        return [env[v] for v in group.outs]

    # The error a worker reports for this executable carries its name: it lists the original nodes.
    names = describe([specs[node.fn].name for node in members])
    name = f"fused({names}) in program {program[:256]}"
    abstract = abstract_mesh(first.mesh.shape, first.mesh.axis_names)
    in_sh = [JaxNamedSharding(abstract, in_shardings[v].spec) for v in group.ins]
    out_sh = [JaxNamedSharding(abstract, out_shardings[v].spec) for v in group.outs]
    args = [jax.ShapeDtypeStruct(avals[v][0], avals[v][1], sharding=s) for v, s in zip(group.ins, in_sh)]
    try:
        exported = jax.export.export(jax.jit(run_group, in_shardings=in_sh, out_shardings=out_sh),
                                     platforms=export_platforms(first.slice.kind))(*args)
    except Exception as e:
        raise ProgramTraceError(f"program {program}: nodes {names} could not be compiled as one function "
                                f"({type(e).__name__}: {e}); call pw.program without fuse=True") from e
    fn_id = define_function(session, first.slice.id, name, exported, [in_shardings[v].layout() for v in group.ins],
                            [out_shardings[v].layout() for v in group.outs])
    return fn_id, name
