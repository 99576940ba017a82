"""Ring attention (pathways.conductor.ring_attention) and the ring order it runs in
(pathways.planner.ring).

The ring order is checked against brute force, both solvers, on seeded random latencies.
Ring attention needs several devices: its checks run in two processes with four CPU devices
each (tests/ring_attention_checks.py, started side by side once for the module), and the
tests below assert on the results they report; the argument checks need no devices and run
here, on an abstract mesh.
"""

import itertools
import math
import random
from pathlib import Path

import pytest

from tests.conftest import run_device_checks
from pathways.planner.ring import _cp_sat_ring, best_ring, ring_from_topology, ring_latencies
from pathways.planner.topology import Device, Link, PlanError, Topology

CHECKS = Path(__file__).with_name("ring_attention_checks.py")
CHECK_TIMEOUT = 240.0
TOLERANCE = 1e-5  # relative, float32


# -- the ring order ------------------------------------------------------------------------


def brute_force(matrix: list[list[float]]) -> tuple[int, ...]:
    """Every order from device 0, the first of the best in lexicographic order: the
    definition of the best ring, written independently of the module."""
    n = len(matrix)

    def key(order: tuple[int, ...]) -> tuple[float, float]:
        hops = [matrix[order[i]][order[(i + 1) % n]] for i in range(n)]
        return max(hops), math.fsum(hops)

    return min(((0, *rest) for rest in itertools.permutations(range(1, n))), key=key)


def random_matrix(n: int, seed: int, *, integers: bool) -> list[list[float]]:
    """Asymmetric latencies; small integers make many rings tie on the bottleneck, so that
    the total has to decide."""
    rng = random.Random(seed)
    draw = (lambda: float(rng.randint(1, 4))) if integers else (lambda: rng.uniform(1e-6, 1e-3))
    return [[0.0 if a == b else draw() for b in range(n)] for a in range(n)]


def score(matrix: list[list[float]], order: tuple[int, ...]) -> tuple[float, float]:
    hops = ring_latencies(matrix, order)
    return max(hops), math.fsum(hops)


@pytest.mark.parametrize("n", range(3, 8))
def test_best_ring_is_the_brute_force_optimum(n: int) -> None:
    for seed in range(12):
        for integers in (False, True):
            matrix = random_matrix(n, seed, integers=integers)
            assert best_ring(matrix) == brute_force(matrix), (n, seed, integers)


@pytest.mark.parametrize("n", [8, 9])
def test_cp_sat_ring_matches_brute_force(n: int) -> None:
    for seed in range(3):
        for integers in (False, True):
            matrix = random_matrix(n, seed, integers=integers)
            got = _cp_sat_ring(matrix, time_limit=30.0)
            assert sorted(got) == list(range(n)) and got[0] == 0
            # Rings that tie (a symmetric pair, say) may differ: compare what they cost.
            (bottleneck, total), (best_bottleneck, best_total) = score(matrix, got), score(matrix, brute_force(matrix))
            assert bottleneck == best_bottleneck, (n, seed, integers)
            assert total == pytest.approx(best_total, rel=1e-9), (n, seed, integers)


def test_small_rings() -> None:
    assert best_ring([[0.0]]) == (0,)
    assert best_ring([[0.0, 5.0], [1.0, 0.0]]) == (0, 1)
    assert ring_latencies([[0.0]], (0,)) == []
    assert ring_latencies([[0, 1, 2], [3, 0, 4], [5, 6, 0]], (0, 2, 1)) == [2.0, 6.0, 3.0]
    # The diagonal is never read: whatever it holds is accepted.
    assert best_ring([[math.nan, 1, 2], [1, -1, 1], [2, 1, math.inf]]) == (0, 1, 2)


def hops_of(order: tuple[int, ...]) -> set[tuple[int, int]]:
    return {(order[i], order[(i + 1) % len(order)]) for i in range(len(order))}


@pytest.mark.parametrize("n", [6, 10])  # the brute-force solver and the CP-SAT one
def test_ring_from_topology_avoids_a_slow_link(n: int) -> None:
    ids = [f"d{i}" for i in range(n)]
    devices = [Device(i, memory_bytes=1 << 30, flops=1e12) for i in ids]
    # The slow link lies on the ring in device order, the first one brute force would try.
    topology = Topology(devices, {("d1", "d2"): Link(1e-3, 1e9)}, default_link=Link(1e-6, 1e9))
    order = ring_from_topology(topology, ids)
    assert sorted(order) == list(range(n))
    assert not hops_of(order) & {(1, 2), (2, 1)}, order


def test_ring_from_topology_uses_the_direction_data_moves() -> None:
    ids = ["a", "b", "c", "d", "e"]
    devices = [Device(i, memory_bytes=1 << 30, flops=1e12) for i in ids]
    # a -> b is slow, b -> a fast: a ring may run b -> a but never a -> b.
    links = {("a", "b"): Link(1e-3, 1e9), ("b", "a"): Link(1e-7, 1e9)}
    order = ring_from_topology(Topology(devices, links, default_link=Link(1e-6, 1e9)), ids)
    assert (0, 1) not in hops_of(order)
    assert (1, 0) in hops_of(order)  # the fast direction also lowers the total


@pytest.mark.parametrize("latency, message", [
    ([], "empty"),
    ([[0, 1], [1]], "square"),
    ([[0, 1, 2], [1, 0, 3]], "square"),
    ([[0, -1], [1, 0]], r"latency\[0\]\[1\]"),
    ([[0, 1], [math.nan, 0]], r"latency\[1\]\[0\]"),
    ([[0, math.inf], [1, 0]], "finite"),
    ([[0, "1"], [1, 0]], "finite number"),
    ([[0, True], [1, 0]], "finite number"),
    (3.0, "square matrix"),
])
def test_bad_latencies_raise_plan_error(latency, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        best_ring(latency)


def test_bad_orders_and_devices_raise_plan_error() -> None:
    matrix = [[0, 1, 2], [1, 0, 3], [2, 3, 0]]
    for order in [(0, 1), (0, 1, 1), (0, 1, 3), (True, 0, 2)]:
        with pytest.raises(PlanError, match="permutation"):
            ring_latencies(matrix, order)
    with pytest.raises(PlanError, match="time_limit"):
        best_ring(matrix, time_limit=0)
    topology = Topology([Device(i, memory_bytes=1, flops=1.0) for i in "xy"], default_link=Link(1e-6, 1e9))
    with pytest.raises(PlanError, match="unknown device 'z'"):
        ring_from_topology(topology, ["x", "z"])
    with pytest.raises(PlanError, match="more than once"):
        ring_from_topology(topology, ["x", "y", "x"])
    with pytest.raises(PlanError, match="no link"):
        ring_from_topology(Topology([Device(i, memory_bytes=1, flops=1.0) for i in "xy"]), ["x", "y"])


# -- ring attention ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checks() -> dict:
    """The results of both groups of checks, {group: {check: result}}."""
    return run_device_checks(CHECKS, ("numerics", "lowering"), CHECK_TIMEOUT)


CASES = ["n4", "n4_order", "n2_batch"]  # 4 devices; another ring order; 2 devices and a batch axis


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_ring_attention_equals_plain_attention(checks: dict, case: str, causal: bool) -> None:
    result = checks["numerics"][f"{case}_causal={causal}"]
    assert result["output"] <= TOLERANCE
    # The output stays split as the inputs were: the sequence over "s", the batch over "b".
    assert result["out_spec"] == ("P('b', None, 's', None)" if case == "n2_batch" else "P(None, None, 's', None)")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_ring_attention_gradients_equal_plain_attention(checks: dict, case: str, causal: bool) -> None:
    grads = checks["numerics"][f"{case}_causal={causal}"]["grads"]
    assert len(grads) == 3  # q, k, v
    assert max(grads) <= TOLERANCE, grads


def test_causal_ring_skips_blocks_after_the_diagonal(checks: dict) -> None:
    numerics, lowering = checks["numerics"], checks["lowering"]
    # Device p computes blocks 0..p: 10 of the 16 pairs on 4 devices, in any ring order.
    for case in ("n4", "n4_order"):
        assert numerics[f"{case}_causal=True"]["counts"] == [[1, 2, 3, 4]]
        assert numerics[f"{case}_causal=False"]["counts"] == [[4, 4, 4, 4]]
    assert numerics["n2_batch_causal=True"]["counts"] == [[1, 2], [1, 2]]
    # A skip is a branch in the compiled program (the loop's and the last step's), not a
    # select that computes the block anyway.
    assert lowering["hlo_causal=True"]["conditionals"] == 2
    assert lowering["hlo_causal=False"]["conditionals"] == 0


def test_blocks_move_in_the_given_ring_order(checks: dict) -> None:
    for causal in (False, True):
        assert checks["lowering"][f"hlo_causal={causal}"]["pairs"] == ["{{0,2},{2,3},{3,1},{1,0}}"]


def test_working_memory_is_a_score_block_not_the_whole_row(checks: dict) -> None:
    memory = checks["lowering"]["memory"]
    # S = 2048 on 4 devices: plain attention sharded the same way holds (S/4) x S scores per
    # head (twice: scores and probabilities), the ring a few (S/4) x (S/4) blocks.
    assert memory["ring"] <= memory["plain"] / 3, memory
    assert memory["ring"] <= 3 * memory["score_block"], memory


def test_abstract_mesh_under_jit_and_export(checks: dict) -> None:
    lowering = checks["lowering"]
    assert lowering["abstract_jit"]["output"] <= TOLERANCE
    assert lowering["abstract_jit"]["out_spec"] == "P(None, None, 's', None)"
    assert lowering["abstract_export"]["output"] <= TOLERANCE


def test_explicit_mesh_axes(checks: dict) -> None:
    assert checks["lowering"]["explicit"]["output"] <= TOLERANCE
    assert checks["lowering"]["explicit"]["out_spec"] == "P(None, None, 's', None)"


def test_ring_attention_rejects_bad_arguments() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from pathways.conductor.ring_attention import ring_attention

    mesh = AbstractMesh((2, 4), ("b", "s"))

    def trace(shape=(2, 2, 32, 8), v_shape=None, **kw) -> None:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        y = jax.ShapeDtypeStruct(v_shape or shape, jnp.float32)
        args = {"mesh": mesh, "axis": "s", "causal": True, "scale": 1.0, **kw}
        jax.eval_shape(lambda q, k, v: ring_attention(q, k, v, **args), x, x, y)

    with pytest.raises(ValueError, match=r"sequence length 30 of q, k, v \(2, 2, 30, 8\).*4 devices"):
        trace((2, 2, 30, 8))
    with pytest.raises(ValueError, match=r"batch size 3 .*'b'"):
        trace((3, 2, 32, 8), batch_axis="b")
    with pytest.raises(ValueError, match="permutation"):
        trace(order=(0, 1, 2, 2))
    with pytest.raises(ValueError, match="not an axis"):
        trace(axis="x")
    with pytest.raises(ValueError, match="own axes"):
        trace(batch_axis="s")
    with pytest.raises(ValueError, match="head size"):
        trace(v_shape=(2, 2, 16, 8))
    trace(v_shape=(2, 2, 32, 4))  # values may have their own head size
