"""``pw.conduct``: unannotated functions sharded by the cost model, on a cluster's slice and on
JAX devices, against plain JAX; the graph it plans over; ring attention under a memory
limit; re-planning; and its errors."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from tests.conduct_models import column_sums, gpt_block, gpt_inputs, mlp, mlp_inputs, mlp_loss, relative_error
from tests.conftest import run_device_checks
from pathways.conductor import pricing
from pathways.conductor.graph import trace
from pathways.planner import PlanError

CHECKS = Path(__file__).with_name("conduct_checks.py")
GROUPS = ("ring", "replan", "small")
TOLERANCE = 1e-5


# ---- the graph ----------------------------------------------------------------------------


def graph_of(fun, *shapes):
    return trace(fun, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])


def kinds(graph):
    return [op.kind for op in graph.operations]


def test_attention_written_in_jax_numpy_is_one_operation_with_its_mask_and_scale():
    params, x = gpt_inputs()
    leaves, tree = jax.tree.flatten((params, x))
    graph = trace(lambda *ls: gpt_block(*jax.tree.unflatten(tree, ls)),
                  [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves])
    (att,) = [op for op in graph.operations if op.kind == "attention"]
    a = att.attention
    assert a.causal and a.scale == pytest.approx(1 / np.sqrt(16))
    assert (a.batch, a.q_len, a.kv_len, a.head_dim) == ((2, 4), 32, 32, 16)
    # the softmax and the masking are inside it, not operations of their own
    assert "exp" not in kinds(graph) and "reduce_max" not in kinds(graph)


def test_attention_without_a_mask_is_recognised_and_other_masks_are_not():
    def attend(q, k, v, mask):
        s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.5
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)

    plain = graph_of(lambda q, k, v: attend(q, k, v, None), (2, 8, 4), (2, 8, 4), (2, 8, 4))
    (att,) = [op for op in plain.operations if op.kind == "attention"]
    assert not att.attention.causal and att.attention.scale == 0.5
    band = jnp.asarray(np.triu(np.tril(np.ones((8, 8), bool)), -2))  # a local window: no ring for it
    banded = graph_of(lambda q, k, v: attend(q, k, v, band), (2, 8, 4), (2, 8, 4), (2, 8, 4))
    assert "attention" not in kinds(banded) and "exp" in kinds(banded)
    # a softmax over the queries' axis is no attention either
    columns = graph_of(lambda q, k, v: jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k),
                                                                                  axis=1), v),
                       (2, 8, 4), (2, 8, 4), (2, 8, 4))
    assert "attention" not in kinds(columns)


def test_reshape_groups_share_a_loop_dimension_on_their_leading_dimensions():
    (op,) = [op for op in graph_of(lambda x: x.reshape(2, 32, 4, 16) * 2.0, (2, 32, 64)).operations
             if op.kind == "reshape"]
    assert op.operand_dims == [(0, 1, 2)] and op.result_dims == [(0, 1, 2, None)]
    assert op.loop == (2, 32, 4)  # 64 -> (4, 16): split as the 4 is


def test_operations_outside_the_vocabulary_stay_whole():
    graph = graph_of(lambda x: jnp.cumsum(x, axis=0) + 1.0, (16, 8))
    (op,) = [op for op in graph.operations if op.kind == "opaque"]
    assert op.loop == () and op.result_dims == [(None, None)]


def test_constants_are_no_operations():
    graph = graph_of(lambda x: x * jnp.arange(8.0) + jnp.ones(8).sum(), (8,))
    assert kinds(graph) == ["input", "mul", "add", "output"]


# ---- pricing ------------------------------------------------------------------------------


def mesh(shape=(4,), latency=1e-5, bandwidth=1e9):
    axes = ("x", "y")[:len(shape)]
    return pricing.Mesh(shape, axes, (latency,) * len(shape), (bandwidth,) * len(shape))


def test_specs_split_each_dimension_over_at_most_one_axis_where_it_divides():
    assert pricing.specs((8, 6), mesh((4,))) == [(None, None), ("x", None)]
    two = pricing.specs((4, 4), mesh((2, 2)))
    assert ("x", "y") in two and ("y", "x") in two and (None, None) in two
    assert all(len({a for a in s if a}) == sum(1 for a in s if a) for s in two)


def test_resharding_costs_gathers_and_all_to_alls_and_nothing_for_slicing():
    m = mesh((4,), latency=1e-5, bandwidth=1e9)
    nbytes = 4e6
    assert pricing.reshard_seconds(nbytes, (None, None), ("x", None), m) == 0.0
    gather = pricing.reshard_seconds(nbytes, ("x", None), (None, None), m)
    assert gather == pytest.approx(3 * (1e-5 + 1e6 / 1e9))
    all_to_all = pricing.reshard_seconds(nbytes, ("x", None), (None, "x"), m)
    assert all_to_all == pytest.approx(3 * (1e-5 + 1e6 / 4e9))


def test_a_split_contraction_costs_an_all_reduce_of_the_result():
    graph = graph_of(lambda a, b: a @ b, (8, 64), (64, 8))
    figures = pricing.Figures(1e9, np.full((4, 4), 1e-5), np.full((4, 4), 1e9))
    m = pricing.meshes(4, figures)[0]
    (dot,) = [op for op in graph.operations if op.kind == "dot_general"]
    cands = pricing.candidates(graph, dot, m, figures, lambda axis: (0.0, 1e9))
    split_k = next(c for c in cands if c.axes[2] == "x")
    assert split_k.reduce_over == ("x",)
    assert split_k.operand_specs == ((None, "x"), ("x", None)) and split_k.result_specs == ((None, None),)
    assert split_k.seconds == pytest.approx(2 * 8 * 64 * 8 / 4 / 1e9 + pricing.all_reduce_seconds(256, "x", m))


# ---- running on a cluster's slice -----------------------------------------------------------


@pytest.fixture
def four(session):
    return pw.make_virtual_device_set().add_slice(cpu_devices=4)


def test_a_conducted_mlp_equals_plain_jax(four):
    params, x = mlp_inputs()
    conducted = pw.conduct(mlp, four.devices)
    out = conducted(params, x)
    assert isinstance(out, pw.Array)
    assert relative_error(pw.device_get(out), mlp(params, x)) < TOLERANCE
    assert conducted.plan.optimal


def test_a_conducted_gpt_block_and_a_conducted_gradient_equal_plain_jax(four):
    params, x = gpt_inputs()
    block = pw.conduct(gpt_block, four.devices)
    assert relative_error(pw.device_get(block(params, x)), jax.jit(gpt_block)(params, x)) < TOLERANCE
    printed = str(block.plan)
    assert "attention" in printed and "predicted" in printed and "peak" in printed
    # A conducted gradient, on the slice (the GPT block's gradients, both through
    # ``.grad()`` and by conducting ``jax.grad``, are checked on JAX devices: the ring group)
    params, x = mlp_inputs()
    want = jax.jit(jax.grad(mlp_loss))(params, x)
    grads = pw.device_get(pw.conduct(jax.grad(mlp_loss), four.devices)(params, x))
    for name in want:
        assert relative_error(grads[name], want[name]) < TOLERANCE, name


def test_a_sum_over_a_split_axis_is_completed_by_an_all_reduce(four):
    x = np.random.default_rng(0).standard_normal((4096, 3)).astype(np.float32)
    # 48 KiB of x cannot stay whole on a device: its long axis is split, and summed over
    conducted = pw.conduct(column_sums, four.devices, memory_limit=40_000)
    assert relative_error(pw.device_get(conducted(x)), column_sums(x)) < TOLERANCE
    assert any("all-reduce" in c for op in conducted.plan.operations for c in op.collectives)
    assert conducted.plan.peak_bytes <= 40_000


def test_a_moved_slice_is_planned_again_from_the_previous_plan(four):
    params, x = mlp_inputs()
    conducted = pw.conduct(mlp, four.devices)
    first = conducted.plan_for(params, x)
    four._physical = four._physical[::-1]  # as a SliceMoved would: other devices behind it
    second = conducted.plan_for(params, x)
    assert second is not first and second.hinted
    assert relative_error(pw.device_get(conducted(params, x)), mlp(params, x)) < TOLERANCE


# ---- errors -------------------------------------------------------------------------------


def test_bad_arguments_are_refused_saying_what_is_expected(four):
    with pytest.raises(ValueError, match="objective"):
        pw.conduct(mlp, four.devices, objective="energy")
    with pytest.raises(ValueError, match="memory_limit"):
        pw.conduct(mlp, four.devices, memory_limit=-1)
    with pytest.raises(pw.SignatureError, match="slice's devices"):
        pw.conduct(mlp, "four devices")
    with pytest.raises(pw.SignatureError, match="no plan yet"):
        pw.conduct(mlp, four.devices).plan
    with pytest.raises(pw.SignatureError, match="could not be traced"):
        pw.conduct(mlp, four.devices).plan_for({"w1": np.ones((3, 4))}, np.ones((2, 3)))


def test_a_memory_limit_no_plan_meets_names_the_smallest_peak(four):
    params, x = mlp_inputs()
    with pytest.raises(PlanError, match="smallest peak"):
        pw.conduct(mlp, four.devices, memory_limit=1000).plan_for(params, x)


# ---- on JAX devices (a process with four) ------------------------------------------------------


@pytest.fixture(scope="module")
def checks():
    return run_device_checks(CHECKS, GROUPS, 240)


def test_under_a_memory_limit_plain_attention_cannot_meet_the_block_runs_ring_attention(checks):
    r = checks["ring"]
    assert r["plain_need"] > r["limit"] >= r["peak"]
    assert r["uses_ring"] and r["loss_uses_ring"] and "ring attention" in r["printed"]
    assert r["output_error"] < TOLERANCE
    assert max(r["grad_errors"].values()) < TOLERANCE
    assert max(r["grad_method_errors"].values()) < TOLERANCE


def test_ring_attention_holds_a_share_of_the_attention_memory(checks):
    r = checks["ring"]
    conducted, plain = r["conducted_memory"], r["plain_memory"]
    # per device: at most 1/n of plain attention's score matrix besides the block's own buffers
    assert conducted["temp"] <= r["score_bytes"] / r["devices"]
    assert conducted["arguments"] <= plain["arguments"] and conducted["outputs"] <= plain["outputs"]
    assert plain["temp"] >= r["score_bytes"]


def test_the_ring_avoids_a_slow_link(checks):
    r = checks["ring"]
    slow = tuple(int(d) for d in r["slow"])
    hops = {tuple(h) for h in r["ring_hops"]}
    assert hops and slow not in hops and slow[::-1] not in hops


def test_a_plan_made_again_from_the_previous_one_is_a_cold_plans_equal_or_says_its_gap(checks):
    r = checks["replan"]
    assert r["hinted"] and r["optimal"][1]
    if r["optimal"][0]:
        assert r["warm_seconds"] == pytest.approx(r["cold_seconds"], rel=1e-9)
    else:  # its time ran out: it is no better than the optimum, and within its stated gap of it
        assert r["cold_seconds"] * (1 - 1e-9) <= r["warm_seconds"] <= r["cold_seconds"] / (1 - r["gap"]) * (1 + 1e-9)
    assert r["first_seconds"] != pytest.approx(r["warm_seconds"])  # the figures did change the plan's cost
    # given the time, a re-plan proves the cold plan's optimum
    assert r["given_time"]["optimal"] and r["given_time"]["seconds"] == pytest.approx(r["cold_seconds"], rel=1e-9)
    assert r["output_error"] < TOLERANCE


def test_small_plans_cost_what_an_exhaustive_search_finds(checks):
    for name, r in checks["small"].items():
        assert r["operations"] <= 12, name
        assert r["plan"] == pytest.approx(r["exhaustive"], rel=1e-9), name
        assert r["error"] < TOLERANCE, name
