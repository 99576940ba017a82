"""``python -m pathways bench conduct``: a training step of an unannotated GPT block sharded
by ``pw.conduct`` next to the same step sharded by hand, and re-planning after the
figures change next to planning from scratch.

On one host with four CPU devices (a slice of all four):

- *Step time*: the gradient of a scalar loss of a GPT block (layernorm, causal multi-head
  attention, an MLP with gelu, residuals; plain jax.numpy) with respect to its parameters,
  five ways: ``pw.conduct(loss, devices).grad()`` (the cost model's plan), and ``pw.jit``
  of ``jax.grad(loss)`` sharded by hand as replicated, data parallel, Megatron tensor
  parallel and sequence parallel. Every version's inputs are placed on the slice in the
  layout it takes, once; every version returns the full gradient on every device. A
  sample is a few calls, each timed until all its results are ready; the versions
  alternate within each round.
- *Re-planning*: the conducted step's signature planned again with other figures (the
  measured topology with every device's FLOP/s scaled) by ``replan``, which keeps the
  traced graph and starts the solver from the previous plan, next to a fresh
  ``pw.conduct`` planning the same signature with the same figures from scratch. Each round
  re-plans for the other figures than the round before, alternating with the cold plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from pathways_bench import report

TITLE = "Conduct: a cost-model plan of an unannotated GPT block against hand-sharded versions"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 9
HEADS = 4
DEVICES = 4
# A full step takes about 50 ms here (the replicated one three times that): long next to
# the runtime's cost per call, short enough for many rounds in a few minutes on 2 cores.
SIZE = {"batch": 8, "seq": 128, "width": 128}
TINY = {"batch": 4, "seq": 16, "width": 32}
CALLS, TINY_CALLS = 5, 1  # steps per sample
FLOPS_SCALE = 8.0  # the re-planned figures: every device this much faster
STEP_TARGET = 1.05  # conducted step time over the best hand-sharded version's, at most
REPLAN_TARGET = 0.20  # re-planning's planning seconds over a cold plan's, at most
VERSIONS = ("conducted", "replicated", "data parallel", "Megatron tensor parallel", "sequence parallel")
BASELINES = VERSIONS[1:]
_TIMEOUT = 120.0

ABOUT = f"""
One host with {DEVICES} CPU devices, a slice of all {DEVICES}. **Step time**: the gradient of
`mean(block(params, x) ** 2)` with respect to the parameters, where `block` is a GPT block in
plain jax.numpy (layernorm, causal {HEADS}-head attention, an MLP with gelu, residuals; batch
{SIZE['batch']}, sequence {SIZE['seq']}, width {SIZE['width']}, float32). *conducted*:
`pw.conduct(loss, slice.devices, topology=measured).grad()`, sharded by the cost model's
plan with the cluster's measured figures (`pathways.cluster.topology`, what `pw.conduct`
reads when given none). The baselines are `pw.jit(jax.grad(loss))` over a mesh of the
{DEVICES} devices, sharded by hand: *replicated* (every device computes everything); *data
parallel* (the batch split); *Megatron tensor parallel* (`wq`, `wk`, `wv` and the first MLP
matrix split by columns, `wo` and the second by rows, so heads and the MLP's hidden units
are split, with an all-reduce after each half); *sequence parallel* (the sequence split, the
keys and values gathered for attention by XLA). Each version's inputs sit on the slice in
its own layout; each returns the full gradient on every device, as the conducted gradient
does. A sample is {CALLS} steps, each timed until all its results are ready; the five
versions alternate within each round, after one call each to compile. Target: the
conducted step within {STEP_TARGET:.2f}x of the best hand-sharded version's.

**Re-planning**: `conducted.replan(topology)` with the measured topology's FLOP/s scaled by
{FLOPS_SCALE:g} (then back, every other round): it keeps the traced graph and starts the
solver from the previous plan; against it, a fresh `pw.conduct(loss, ..., topology=...)`
planning the same signature with the same figures (tracing, pricing and solving).
*Planning* is everything `plan_for` or `replan` does (`plan.planning_seconds`), *solve*
the exact solver's time over every mesh shape (`plan.solve_seconds`).
On one host every pair of devices shares the same link figures, so the devices' speed is
the figure that changes. Target: re-planning within {REPLAN_TARGET:.0%} of a cold plan's time.
"""


# ---- the model: a GPT block in plain jax.numpy ----------------------------------------------


def _unplaced(site: str, value: Any) -> Any:
    return value


def _layernorm(x: Any, gain: Any, bias: Any) -> Any:
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * gain + bias


def block(params: dict, x: Any, place: Callable[[str, Any], Any] = _unplaced) -> Any:
    """A GPT block; ``place(site, value)`` is where the hand-sharded versions constrain
    activations (sites: residual, q, kv, attended, hidden), a no-op otherwise."""
    import jax
    import jax.numpy as jnp

    batch, seq, width = x.shape
    d = width // HEADS

    def split(t: Any) -> Any:
        return t.reshape(batch, seq, HEADS, d).transpose(0, 2, 1, 3)

    x = place("residual", x)
    h = _layernorm(x, params["g1"], params["b1"])
    q = place("q", split(h @ params["wq"]))
    k, v = place("kv", split(h @ params["wk"])), place("kv", split(h @ params["wv"]))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(d)
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    attended = place("attended", jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v))
    x = place("residual", x + attended.transpose(0, 2, 1, 3).reshape(batch, seq, width) @ params["wo"])
    h = _layernorm(x, params["g2"], params["b2"])
    return place("residual", x + place("hidden", jax.nn.gelu(h @ params["w1"])) @ params["w2"])


def loss(params: dict, x: Any) -> Any:
    return (block(params, x) ** 2).mean()


def inputs(batch: int, seq: int, width: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"g1": (width,), "b1": (width,), "wq": (width, width), "wk": (width, width), "wv": (width, width),
              "wo": (width, width), "g2": (width,), "b2": (width,), "w1": (width, 4 * width),
              "w2": (4 * width, width)}
    params = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    params["g1"] += 1.0
    params["g2"] += 1.0
    return params, rng.standard_normal((batch, seq, width)).astype(np.float32)


# ---- the hand-sharded versions ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A hand-sharded version over a 1-D mesh ``x`` of the devices: the parameters' and the
    input's specs, and the activations' specs at ``block``'s sites (unlisted: left to XLA)."""

    params: dict
    x: tuple
    sites: dict


def _shardings() -> dict[str, Sharding]:
    from jax.sharding import PartitionSpec as P

    whole = {k: P() for k in ("g1", "b1", "wq", "wk", "wv", "wo", "g2", "b2", "w1", "w2")}
    columns, rows = P(None, "x"), P("x", None)
    heads = P(None, "x", None, None)
    tokens = P(None, "x", None)
    return {
        "replicated": Sharding(whole, P(), {}),
        "data parallel": Sharding(whole, P("x", None, None), {"residual": P("x", None, None)}),
        "Megatron tensor parallel": Sharding(
            {**whole, "wq": columns, "wk": columns, "wv": columns, "w1": columns, "wo": rows, "w2": rows}, P(),
            {"q": heads, "kv": heads, "attended": heads, "hidden": P(None, None, "x"), "residual": P()}),
        # queries stay split with the sequence; keys and values are unconstrained, so XLA
        # gathers them for attention
        "sequence parallel": Sharding(whole, tokens, {"residual": tokens, "hidden": tokens,
                                                      "q": P(None, None, "x", None),
                                                      "attended": P(None, None, "x", None)}),
    }


def _hand_step(name: str, sharding: Sharding, mesh: Any) -> Callable:
    """``jax.grad(loss)`` with the activations constrained as ``sharding`` says, compiled by
    ``pw.jit`` over ``mesh``."""
    import jax
    from jax.sharding import NamedSharding

    import pathways as pw
    from pathways.client.compiled import abstract_mesh

    abstract = abstract_mesh(mesh.shape, mesh.axis_names)

    def place(site: str, value: Any) -> Any:
        spec = sharding.sites.get(site)
        return value if spec is None else jax.lax.with_sharding_constraint(value, NamedSharding(abstract, spec))

    def step(params: dict, x: Any) -> dict:
        return jax.grad(lambda p, x: (block(p, x, place) ** 2).mean())(params, x)

    step.__name__ = f"grad_{name.replace(' ', '_')}"
    return pw.jit(step, mesh=mesh, in_shardings=(sharding.params, sharding.x))


def _put(args: tuple, mesh: Any, specs: list) -> tuple:
    """``args`` on the slice, each leaf laid out by its spec (``specs`` in leaf order)."""
    import jax

    import pathways as pw

    leaves, tree = jax.tree.flatten(args)
    return jax.tree.unflatten(tree, [pw.device_put(leaf, pw.NamedSharding(mesh, spec))
                                     for leaf, spec in zip(leaves, specs)])


def _leaf_specs(sharding: Sharding) -> list:
    import jax
    from jax.sharding import PartitionSpec

    return jax.tree.leaves((sharding.params, sharding.x), is_leaf=lambda s: isinstance(s, PartitionSpec))


def _timed(step: Callable, args: tuple, calls: int) -> Callable[[], float]:
    """A sample: ``calls`` steps, each waited for until all its results are ready; seconds per step."""
    import jax

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            for leaf in jax.tree.leaves(step(*args)):
                leaf.block_until_ready(_TIMEOUT)
        return (time.perf_counter() - start) / calls

    return run


# ---- measuring --------------------------------------------------------------------------------


def _attention_split(plan: Any) -> str:
    """What the plan splits attention's result (batch, heads, sequence, head width) along."""
    i = next(i for i, op in enumerate(plan.graph.operations) if op.kind == "attention")
    spec = plan.chosen(i).result_specs[0]
    return ", ".join(f"{dim} over {axis}" for dim, axis in zip(("batch", "heads", "sequence", "head width"), spec)
                     if axis) or "nothing"


def _plan_record(plan: Any) -> dict:
    return {"mesh": dict(zip(plan.axis_names, plan.mesh_shape)), "optimal": plan.optimal, "gap": plan.gap,
            "predicted_seconds": plan.predicted_seconds, "planning_seconds": plan.planning_seconds,
            "solve_seconds": plan.solve_seconds, "ring_attention": plan.uses_ring_attention,
            "attention_split": _attention_split(plan), "hinted": plan.hinted}


def _scaled(topo: Any, factor: float) -> Any:
    from pathways.planner import Topology

    return Topology([dataclasses.replace(d, flops=d.flops * factor) for d in topo.devices], topo.links,
                    topo.default_link)


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    import pathways as pw
    from pathways.cluster import measured_topology

    size = TINY if tiny else SIZE
    calls = TINY_CALLS if tiny else CALLS
    progress.expect(1 + len(VERSIONS) + rounds * (len(VERSIONS) + 2))
    progress.step(f"starting a host of {DEVICES} devices")
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=DEVICES)]) as cluster:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=DEVICES)
        measured = measured_topology(cluster.address)
        args = inputs(**size)
        conducted = pw.conduct(loss, s.devices, topology=measured)
        steps, errors = _versions(s, conducted, args, progress)
        samples = report.alternate(rounds, {name: _timed(step, placed, calls)
                                            for name, (step, placed) in steps.items()}, progress)
        replans = _replan(s, conducted, args, measured, rounds, progress)
    step_seconds = {name: report.stats(v) for name, v in samples.items()}
    ratios = {b: report.ratio(step_seconds["conducted"], step_seconds[b]) for b in BASELINES}
    best = min(BASELINES, key=lambda b: step_seconds[b]["median"])
    return {"size": {**size, "heads": HEADS, "devices": DEVICES}, "calls": calls, "versions": list(VERSIONS),
            "step_seconds": step_seconds, "ratios": ratios, "best_baseline": best, "ratio_to_best": ratios[best],
            "max_gradient_error": errors, "plan": replans.pop("first"), "replan": replans,
            "targets": {"step": STEP_TARGET, "replan": REPLAN_TARGET}}


def _versions(s: Any, conducted: Any, args: tuple, progress: report.Progress) -> tuple[dict, dict]:
    """Every version's compiled step with its inputs placed on ``s``, compiled by a first
    call (the conducted one planned first); each gradient's largest error relative to
    plain JAX here."""
    import jax

    import pathways as pw
    from pathways.client.devices import VirtualMesh

    want = jax.grad(loss)(*args)
    progress.step("planning and compiling conducted")
    plan = conducted.plan_for(*args)
    steps = {"conducted": (conducted.grad(), _put(args, VirtualMesh(s, plan.mesh_shape, plan.axis_names),
                                                  plan.in_specs))}
    mesh = s.mesh("x")
    for name, sharding in _shardings().items():
        steps[name] = (_hand_step(name, sharding, mesh), _put(args, mesh, _leaf_specs(sharding)))
    errors = {}
    for name, (step, placed) in steps.items():
        if name != "conducted":
            progress.step(f"compiling {name}")
        got = pw.device_get(step(*placed))
        errors[name] = max(float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want)
    return steps, errors


def _replan(s: Any, conducted: Any, args: tuple, measured: Any, rounds: int, progress: report.Progress) -> dict:
    """Re-planning ``conducted`` (planned with the ``measured`` figures) for other figures,
    round after round, against a cold plan for the same figures."""
    import pathways as pw

    figures = [measured, _scaled(measured, FLOPS_SCALE)]
    first = conducted.plan
    warm, cold = [], []
    for r in range(rounds):
        topo = figures[(r + 1) % 2]  # the other figures than the current plan's
        progress.step(f"re-plan (round {r + 1}/{rounds})")
        warm.append(conducted.replan(topo))
        progress.step(f"cold plan (round {r + 1}/{rounds})")
        cold.append(pw.conduct(loss, s.devices, topology=topo).plan_for(*args))
    planning = {mode: report.stats([p.planning_seconds for p in plans]) for mode, plans in (("warm", warm),
                                                                                             ("cold", cold))}
    return {"flops_scale": FLOPS_SCALE, "first": _plan_record(first),
            "warm": [_plan_record(p) for p in warm], "cold": [_plan_record(p) for p in cold],
            "planning_seconds": planning,
            "solve_seconds": {mode: report.stats([p.solve_seconds for p in plans])
                              for mode, plans in (("warm", warm), ("cold", cold))},
            "ratio": report.ratio(planning["warm"], planning["cold"]),
            "hinted": all(p.hinted for p in warm),
            # re-planning must find a plan as good as planning from scratch
            "same_cost": all(math.isclose(w.predicted_seconds, c.predicted_seconds, rel_tol=1e-9)
                             for w, c in zip(warm, cold)),
            # how far a re-plan's predicted step time is from the cold plan's, at worst (a search
            # cut short by its time limit, as --tiny's are, may stop at a costlier plan)
            "cost_gap": max(abs(w.predicted_seconds / c.predicted_seconds - 1) for w, c in zip(warm, cold)),
            "all_optimal": all(p.optimal for p in warm + cold),
            "plan_changed": any(p.choices != first.choices or p.mesh_shape != first.mesh_shape for p in warm)}


# ---- reporting --------------------------------------------------------------------------------


def _ms(s: dict) -> str:
    return report.rate({k: v * 1e3 if k != "n" else v for k, v in s.items()}, 1)


def _mesh(m: dict) -> str:
    return " x ".join(f"{a}={n}" for a, n in m.items())


def _plan_row(label: str, p: dict) -> list[str]:
    return [label, _mesh(p["mesh"]), p["attention_split"], "yes" if p["ring_attention"] else "no",
            "yes" if p["optimal"] else "no", f"{p['gap']:.1%}", f"{p['predicted_seconds'] * 1e3:.2f}",
            f"{p['planning_seconds']:.2f}", f"{p['solve_seconds']:.2f}", "yes" if p["hinted"] else "no"]


def tables(data: dict) -> list[report.Table]:
    size, steps = data["size"], data["step_seconds"]
    rows = [[name, _ms(steps[name]),
             "-" if name == "conducted" else report.times(data["ratios"][name]),
             f"{data['max_gradient_error'][name]:.1e}"] for name in data["versions"]]
    r = data["replan"]
    replan_rows = [[mode, report.rate(r["planning_seconds"][mode], 2), report.rate(r["solve_seconds"][mode], 2)]
                   for mode in ("cold", "warm")]
    plan_rows = [_plan_row("the step (measured figures)", data["plan"]),
                 _plan_row("cold, last round", r["cold"][-1]), _plan_row("re-planned, last round", r["warm"][-1])]
    return [
        report.Table(f"GPT block training step on {size['devices']} CPU devices (batch {size['batch']}, sequence "
                     f"{size['seq']}, width {size['width']}, {size['heads']} heads): ms per step, median (min-max)",
                     ["version", "ms per step", "conducted / version", "gradient error"], rows),
        report.Table(f"Planning the step: a fresh pw.conduct (cold) against replan for FLOP/s scaled by "
                     f"{r['flops_scale']:g} or back (warm): seconds, median (min-max)",
                     ["plan", "planning", "solve"], replan_rows),
        report.Table("The plans", ["plan", "mesh", "attention split", "ring attention", "optimal", "gap",
                                   "predicted ms", "planning s", "solve s", "hinted"], plan_rows),
    ]


def summary(data: dict) -> list[str]:
    best, ratio = data["best_baseline"], data["ratio_to_best"]
    target = data["targets"]["step"]
    verdict = report.verdict(data, ratio <= target, f"**missed** by {ratio - target:.2f}x")
    r = data["replan"]
    rtarget = data["targets"]["replan"]
    rverdict = report.verdict(data, r["ratio"] <= rtarget, f"**missed** by {r['ratio'] - rtarget:.0%}")
    return [*report.unjudged(data),
            f"The conducted step takes {ratio:.2f}x the time of the best hand-sharded version ({best}; "
            f"target <= {target:.2f}x): {verdict}.",
            f"Re-planning takes {r['ratio']:.0%} of a cold plan's time (median planning seconds "
            f"{r['planning_seconds']['warm']['median']:.2f} against {r['planning_seconds']['cold']['median']:.2f}; "
            f"target <= {rtarget:.0%}): {rverdict}. Every re-plan started from the previous plan: "
            f"{'yes' if r['hinted'] else 'no'}; {_cost_comparison(r)}; the new figures changed the plan: "
            f"{'yes' if r['plan_changed'] else 'no'}."]


def _cost_comparison(r: dict) -> str:
    if r["same_cost"]:
        return "each found a plan as cheap as the cold one"
    cut = "" if r["all_optimal"] else " (some searches ended at their time limit before proving a plan optimal)"
    return f"the re-plans' predicted step times differ from the cold plans' by up to {r['cost_gap']:.1%}{cut}"


def notes(data: dict) -> str:
    plan, r = data["plan"], data["replan"]
    if plan["attention_split"] == "batch over x" and plan["mesh"] == {"x": DEVICES}:
        chose = ("splits the batch over all four devices, as data parallelism does: every device computes "
                 "a quarter of the block, and only the parameters' gradients are all-reduced (then held "
                 "whole, as every version returns them)")
    else:
        chose = f"runs on a mesh {_mesh(plan['mesh'])} and splits attention's {plan['attention_split']}"
    from pathways.conductor.api import REPLAN_SHARE as share

    warm = r["planning_seconds"]["warm"]["median"]
    solve = r["solve_seconds"]["warm"]["median"]
    return f"""
At this size the cost model's plan {chose}. Replicated computes the whole step on each of
the four devices, which share two cores here; Megatron tensor parallelism all-reduces the
activations after attention and after the MLP, forward and backward; sequence parallelism
gathers the keys and values for attention. The spread of a version across rounds is mostly
other processes on the same two cores; compare the medians, and only differences larger
than that spread. A plan's *predicted ms* is the cost model's time for the loss alone (the
forward pass) at the measured FLOP/s: it ranks plans, it does not forecast the step.

A plan prices each operation's candidates and solves once per mesh shape of the devices
(all {DEVICES} on one axis, and 2 x 2). `replan` keeps the traced graph, prices again, and
starts the solver on every mesh shape from the previous plan's solution there, giving it
{share:.0%} of the time the cold solve of that shape took (`REPLAN_SHARE` in
`pathways/conductor/api.py`): it returns a plan at least as good as the previous one
re-priced, proven optimal when the proof fits in that time (the table's *optimal* and *gap*
say so per plan). Of a re-plan's {warm:.2f} s (median), {solve:.2f} s is the solver's.
"""


def plot(data: dict, path: str) -> None:
    """Milliseconds per step, one bar per version (median)."""
    report.plot_bars(path, f"GPT block training step on {DEVICES} CPU devices", "ms per step (median)", ["median"],
                     {name: [data["step_seconds"][name]["median"] * 1e3] for name in data["versions"]})
