"""``pw.pipeline``: split a layered model over slices with the planner, and run it.

A model here is one function applied layer after layer, ``x = layer_fn(params[i], x)``.
The partitioner (pathways.planner) chooses which slices run which contiguous range of
layers, from each layer's cost and each slice's measured speed and memory and the links
between them. Each stage becomes a ``pw.jit`` of its layers on its slice, with its
parameters put there once, and a call of the pipeline is one ``@pw.program`` chaining
the stages: the activations move from slice to slice worker to worker.

A slice is one planner device, named by its workers' ids joined with ``+`` (a one-host
slice on worker 3 is ``"3"``, as in ``Topology.from_status``). Its figures come from
the controller: the FLOP/s and memory of its hosts, in proportion to the devices of each
host it holds, and the slowest of the measured links between its hosts and another
slice's. The slices must lie on distinct workers, so that those figures are theirs alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import numpy as np

from pathways.client.api import device_put
from pathways.client.array import Array
from pathways.client.compiled import jit
from pathways.client.devices import Slice
from pathways.client.program import program
from pathways.errors import PlacementError, SignatureError
from pathways.ir import DISPATCH_MODES

# The planner is imported where a pipeline is planned, not with the package: every worker
# and controller process imports the package and never plans.
if TYPE_CHECKING:
    from pathways.planner import Layer, PipelinePlan, Topology


@dataclass(frozen=True)
class PipelineStage:
    """``slice`` runs layers ``[start, end)``."""

    slice: Slice
    start: int
    end: int


class Pipeline:
    """A planned pipeline: ``plan`` (the planner's PipelinePlan), ``stages`` (which slice
    runs which layers, in order), ``layers`` and ``topology`` (what the plan was made
    from). Calling it with an input runs every stage as one program and returns the last
    stage's output (a pw.Array, or a pytree of them)."""

    def __init__(self, layer_fn: Callable, params: Sequence[Any], plan: PipelinePlan,
                 stages: tuple[PipelineStage, ...], layers: tuple[Layer, ...], topology: Topology,
                 dispatch: str) -> None:
        self.plan = plan
        self.stages = stages
        self.layers = layers
        self.topology = topology
        fns = [jit(_compose(layer_fn), mesh=s.slice.mesh(_axis_names(s.slice))) for s in stages]
        # Each stage's parameters go to its slice once and stay there for every call.
        self._params = [device_put(list(params[s.start:s.end]), s.slice.devices) for s in stages]

        def chain(x: Any, *stage_params: Any) -> Any:
            for fn, p in zip(fns, stage_params):
                x = fn(p, x)
            return x

        chain.__name__ = f"pipeline_of_{len(stages)}_stages"
        self._program = program(chain, dispatch=dispatch)

    def __call__(self, x: Any) -> Any:
        return self._program(x, *self._params)

    def __repr__(self) -> str:
        ranges = ", ".join(f"layers {s.start}-{s.end - 1} on slice {s.slice.id}" for s in self.stages)
        return f"Pipeline({ranges})"


def pipeline(layer_fn: Callable, params: Sequence[Any], example_input: Any, slices: Sequence[Slice],
             objective: str = "throughput", strategy: str = "optimal", *,
             layers: Optional[Sequence[Layer]] = None, topology: Optional[Topology] = None,
             dispatch: str = "parallel", time_limit: float = 10.0) -> Pipeline:
    """Plan ``layer_fn`` over ``slices`` and return the runnable Pipeline.

    ``params`` holds one pytree of arrays per layer; layer ``i`` computes
    ``layer_fn(params[i], x)`` and its output is the next layer's input. ``example_input``
    (an array or pytree, only its shapes and dtypes matter) is what the layer costs are
    estimated for, unless ``layers`` gives them (one planner Layer per layer): the FLOPs
    from XLA's cost analysis, the parameter bytes, and the output bytes, which are what
    crosses a link between stages. ``objective`` (``"throughput"`` or ``"latency"``),
    ``strategy`` (``"optimal"`` or ``"memory_weighted"``) and ``time_limit`` go to
    ``pathways.planner.pipeline_partition``. ``topology`` replaces the measured figures:
    its devices must be named like the slices (see the module's docstring). The plan
    may leave slices out. ``dispatch``: as for ``pw.program``.
    """
    from pathways.planner import Topology, pipeline_partition

    params = list(params)
    slices = list(slices)
    if not params:
        raise SignatureError("pw.pipeline needs the parameters of at least one layer")
    if not slices or not all(isinstance(s, Slice) for s in slices):
        raise PlacementError("pw.pipeline needs a list of slices from pw.make_virtual_device_set().add_slice(...)")
    if any(s.session is not slices[0].session for s in slices):
        raise PlacementError("pw.pipeline's slices belong to different sessions; use slices of one session")
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch={dispatch!r}: choose one of {DISPATCH_MODES}")
    by_id = _slice_ids(slices)
    if layers is None:
        layers = estimate_layers(layer_fn, params, example_input)
    layers = tuple(layers)
    if len(layers) != len(params):
        raise SignatureError(f"pw.pipeline got {len(layers)} layer costs for {len(params)} layers' parameters")
    if topology is None:
        topology = slice_topology(slices, slices[0].session.cluster())
    elif not isinstance(topology, Topology):
        raise PlacementError(f"topology must be a pathways.planner.Topology, got {type(topology).__name__}")
    strangers = [d.id for d in topology.devices if d.id not in by_id]
    if strangers:
        raise PlacementError(f"topology device(s) {strangers} name none of the slices; a slice's device is "
                             f"named by its workers joined with '+': {sorted(by_id)}")
    plan = pipeline_partition(topology, layers, objective, strategy, time_limit=time_limit)
    stages = tuple(PipelineStage(by_id[s.device], s.start, s.end)
                   for s in sorted(plan.stages, key=lambda s: s.start) if s.end > s.start)
    return Pipeline(layer_fn, params, plan, stages, layers, topology, dispatch)


def estimate_layers(layer_fn: Callable, params: Sequence[Any], example_input: Any) -> list[Layer]:
    """Each layer's cost for an input like ``example_input``: the FLOPs XLA's cost analysis
    counts, the bytes of its parameters, and the bytes of its output."""
    from pathways.planner import Layer

    x = jax.tree.map(_abstract, example_input)
    jitted = jax.jit(layer_fn)
    out = []
    for i, p in enumerate(params):
        p = jax.tree.map(_abstract, p)
        try:
            lowered = jitted.lower(p, x)  # one trace gives both the cost and the output's shape
            cost, y = lowered.cost_analysis(), lowered.out_info
        except Exception as e:
            raise SignatureError(f"layer {i} failed to trace with its parameters and the previous layer's "
                                 f"output: {type(e).__name__}: {e}") from e
        if isinstance(cost, (list, tuple)):  # some jax versions give one dict per computation
            cost = cost[0] if cost else {}
        out.append(Layer(max(float((cost or {}).get("flops", 0.0)), 0.0), _nbytes(p), _nbytes(y)))
        x = y
    return out


def slice_topology(slices: Sequence[Slice], status: dict) -> Topology:
    """The planner topology of ``slices`` from the controller's ``status``: one device per
    slice and the links between every two of them, from the measured figures."""
    from pathways.planner import Device, Link, Topology

    workers = {w["worker"]: w for w in status["workers"]}
    devices, missing = [], []
    for s in slices:
        flops, memory = 0.0, 0
        held = s.count // len(s.workers)  # a slice takes as many devices on each of its hosts
        for w in s.workers:
            host = workers.get(w)
            if host is None:
                raise PlacementError(f"slice {s.id} lies on worker {w}, which is gone; ask for a new slice")
            if not host.get("flops"):
                missing.append(w)
                continue
            flops += host["flops"] * held / host["devices"]
            memory += host["memory_bytes"] * held // host["devices"]
        devices.append(Device(_slice_id(s), memory, flops, s.kind))
    measured = {(link["src"], link["dst"]): link for link in status.get("links", [])}
    links = {}
    for a in slices:
        for b in slices:
            if a is b:
                continue
            pairs = [measured.get((x, y)) for x in a.workers for y in b.workers]
            if None in pairs:
                missing.extend(x for x in a.workers for y in b.workers if (x, y) not in measured)
                continue
            links[(_slice_id(a), _slice_id(b))] = Link(max(p["latency"] for p in pairs),
                                                       min(p["bandwidth"] for p in pairs))
    if missing:
        raise PlacementError(f"the FLOP/s or links of worker(s) {sorted(set(missing))} are not measured yet "
                             "(workers measure themselves in the background when they start); call "
                             "pathways.cluster.measure(address) first, or pass topology=")
    return Topology(devices, links)


def _slice_ids(slices: Sequence[Slice]) -> dict[str, Slice]:
    owner: dict[int, Slice] = {}
    for s in slices:
        for w in s.workers:
            if w in owner:
                raise PlacementError(
                    f"slices {owner[w].id} and {s.id} share worker {w}; a pipeline plans one stage per slice "
                    "and needs every slice on workers of its own, so that a worker's measured speed, "
                    "memory and links describe one slice. Ask for one slice per host (a cluster with "
                    "more hosts, or add_slice(island=...) per island)")
            owner[w] = s
    return {_slice_id(s): s for s in slices}


def _slice_id(s: Slice) -> str:
    return "+".join(str(w) for w in s.workers)


def _axis_names(s: Slice) -> tuple[str, ...]:
    return tuple(f"pipeline{i}" for i in range(len(s.mesh_shape)))


def _compose(layer_fn: Callable) -> Callable:
    def stage(stage_params: list, x: Any) -> Any:
        for p in stage_params:
            x = layer_fn(p, x)
        return x

    stage.__name__ = f"stage_of_{getattr(layer_fn, '__name__', 'layer')}"
    return stage


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    value = np.asarray(leaf) if not hasattr(leaf, "shape") else leaf
    return jax.ShapeDtypeStruct(value.shape, jax.dtypes.canonicalize_dtype(value.dtype))


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))
