"""The JAX side of tests/test_conduct.py that needs several JAX devices of its own: run as
``python conduct_checks.py GROUP`` in a process with four CPU devices, it runs one group of
checks with ``pw.conduct`` over ``jax.devices()`` and prints the results as one JSON object
on its last line.

Groups:

- ``ring``: a GPT block with a long sequence under a memory limit that plain attention
  cannot meet: whether the plan uses ring attention, its outputs and gradients against plain
  JAX, the compiled executables' memory, and the ring order in a topology with one slow link;
- ``replan``: a plan made again with other figures, from the previous plan, against a cold
  plan with the same figures;
- ``small``: on functions of at most 12 operations, the plan's cost against an exhaustive
  search over the same candidates.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw
from tests.conduct_models import gpt_block, gpt_inputs, gpt_loss, relative_error
from pathways.planner import Device, Link, Topology

SLOW = ("0", "1")  # the slow link of the ``ring`` group's topology


def topology(flops=1e10, latency=20e-6, slow=None):
    devices = [Device(str(i), 2 ** 33, flops) for i in range(4)]
    links = {}
    if slow is not None:
        links = {slow: Link(latency * 1000, 1e6), slow[::-1]: Link(latency * 1000, 1e6)}
    return Topology(devices, links, default_link=Link(latency, 1e9))


def attention_candidates(plan):
    i = next(i for i, op in enumerate(plan.graph.operations) if op.kind == "attention")
    return plan.candidates[i]


def ring_hops(plan):
    """The (device, device) pairs the chosen ring passes blocks over."""
    axis = next(c.ring for c in (plan.chosen(i) for i in range(len(plan.choices))) if c.ring is not None)
    order = plan.ring_orders[axis]
    return sorted({(int(line[a]), int(line[b])) for line in plan.mesh.positions(axis)
                   for a, b in zip(order, order[1:] + order[:1])})


def memory(fun, args, shardings=(None, None)):
    m = jax.jit(fun, in_shardings=shardings[0], out_shardings=shardings[1]).lower(*args).compile().memory_analysis()
    return {"temp": m.temp_size_in_bytes, "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes}


def ring() -> dict:
    params, x = gpt_inputs(batch=1, seq=512, width=32)
    heads, seq = 4, x.shape[1]
    score_bytes = x.shape[0] * heads * seq * seq * 4
    # Below what plain attention needs per device however it is split (the scores of a
    # quarter of the queries, twice), above what a ring needs.
    limit = score_bytes / 4
    c = pw.conduct(gpt_block, jax.devices(), memory_limit=limit, topology=topology(slow=SLOW))
    plan = c.plan_for(params, x)
    plain_need = min(cand.working_bytes for cand in attention_candidates(plan) if cand.ring is None)
    out = c(params, x)
    grads = jax.jit(jax.grad(lambda p, x: (c.jax_fun(p, x) ** 2).mean()), in_shardings=c.shardings[0])(params, x)
    want_grads = jax.jit(jax.grad(gpt_loss))(params, x)  # one compile, not one per operation
    via_grad = c.grad()
    loss_c = pw.conduct(gpt_loss, jax.devices(), memory_limit=limit, topology=topology(slow=SLOW))
    loss_grads = loss_c.grad()(params, x)
    return {
        "limit": limit, "plain_need": plain_need, "uses_ring": plan.uses_ring_attention,
        "loss_uses_ring": loss_c.plan.uses_ring_attention, "peak": plan.peak_bytes,
        "output_error": relative_error(out, jax.jit(gpt_block)(params, x)),
        "grad_errors": {k: relative_error(grads[k], want_grads[k]) for k in want_grads},
        "grad_method_errors": {k: relative_error(loss_grads[k], want_grads[k]) for k in want_grads},
        "grad_of_block_is_callable": callable(via_grad),
        "score_bytes": score_bytes, "devices": 4,
        "plain_memory": memory(gpt_block, (params, x)),
        "conducted_memory": memory(c.jax_fun, (params, x), c.shardings),
        "ring_hops": ring_hops(plan), "slow": list(SLOW),
        "printed": str(plan),
    }


def replan() -> dict:
    params, x = gpt_inputs()
    first = pw.conduct(gpt_block, jax.devices(), topology=topology())
    cold_plan = first.plan_for(params, x)
    other = topology(flops=1e12, latency=1e-3)
    warm = first.replan(other)
    cold = pw.conduct(gpt_block, jax.devices(), topology=other).plan_for(params, x)
    given_time = first.replan(other, time_limit=30.0)
    out = first(params, x)
    return {"hinted": warm.hinted, "warm_seconds": warm.predicted_seconds, "cold_seconds": cold.predicted_seconds,
            "first_seconds": cold_plan.predicted_seconds, "optimal": [warm.optimal, cold.optimal], "gap": warm.gap,
            "warm_planning": warm.planning_seconds, "cold_planning": cold.planning_seconds,
            "given_time": {"optimal": given_time.optimal, "seconds": given_time.predicted_seconds},
            "output_error": relative_error(out, jax.jit(gpt_block)(params, x))}


SMALL = {
    "matmul chain": (lambda a, b, c: jnp.tanh(a @ b) @ c, [(64, 32), (32, 128), (128, 16)]),
    "reduction": (lambda x, w: (x @ w).sum(0), [(256, 8), (8, 64)]),
    "residual": (lambda x, w: x + jax.nn.relu(x @ w), [(32, 64), (64, 64)]),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1) * 2.0, [(16, 64)]),
}


def small() -> dict:
    from pathways.conductor.api import _as_choice, _transfers
    from pathways.planner.sharding import Operation, exhaustive_sharding, plan_seconds

    out = {}
    for name, (fun, shapes) in SMALL.items():
        args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        for seed, (flops, latency) in enumerate(((1e9, 20e-6), (1e11, 1e-6))):
            c = pw.conduct(fun, jax.devices(), topology=topology(flops=flops, latency=latency))
            plan = c.plan_for(*args)
            ops = [Operation(op.name, tuple(_as_choice(x) for x in cands))
                   for op, cands in zip(plan.graph.operations, plan.candidates)]
            transfers = _transfers(plan.graph, plan.candidates, plan.mesh)
            best = exhaustive_sharding(ops, transfers)
            out[f"{name} {seed}"] = {"operations": len(ops), "plan": plan_seconds(ops, transfers, plan.choices),
                                     "exhaustive": best.seconds, "predicted": plan.predicted_seconds}
            values = [np.random.default_rng(seed).standard_normal(s).astype(np.float32) for s in shapes]
            out[f"{name} {seed}"]["error"] = relative_error(c(*values), fun(*values))
    return out


if __name__ == "__main__":
    group = {"ring": ring, "replan": replan, "small": small}[sys.argv[1]]
    print(json.dumps(group()))
