"""The sharding solver behind pw.conduct: one choice per operation, least total time under a
per-device memory limit. Checked against enumeration of every plan on random small graphs,
on trees (dynamic programming), with a previous plan as hint, on invalid inputs, and for
speed on a transformer-sized chain with residual connections."""

import dataclasses
import itertools
import math
import random

import pytest

import pathways.planner.sharding as sharding
from pathways.planner.sharding import (Choice, Operation, ShardingSolution, Transfer, _least_peak,
                                       exhaustive_sharding, plan_peak_bytes, plan_seconds, solve_sharding)
from pathways.planner.topology import PlanError


def random_problem(rng: random.Random, *, tree: bool = False, max_ops: int = 12):
    """Up to ``max_ops`` operations with 1-4 choices (at most 20,000 plans), costs that are
    often zero, integer byte counts, and a random DAG over a shuffled order (so a transfer
    may go from a higher index to a lower one) with fan-out, fan-in and parallel transfers;
    with ``tree``, every operation but the first has at most one predecessor (a forest)."""
    while True:
        n = rng.randint(1, max_ops) if rng.random() < 0.2 else rng.randint(max_ops // 2, max_ops)
        counts = [rng.randint(1, 4) for _ in range(n)]
        if math.prod(counts) <= 20_000:
            break

    def amount() -> float:
        return rng.choice([0.0, 0.0, rng.uniform(0, 1), rng.uniform(0, 1), float(rng.randint(1, 5))])

    ops = [Operation(f"op{i}", tuple(Choice(f"c{k}", amount(), float(rng.randint(0, 100)), float(rng.randint(0, 100)))
                                     for k in range(counts[i]))) for i in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    pairs = []
    for p in range(1, n):
        if tree:
            parents = [order[rng.randrange(p)]] if rng.random() < 0.9 else []
        else:
            parents = rng.sample(order[:p], rng.randint(1 if rng.random() < 0.9 else 0, min(p, 3)))
        pairs += [(q, order[p]) for q in parents]
    if pairs and not tree and rng.random() < 0.3:
        pairs.append(rng.choice(pairs))  # a parallel transfer

    def matrix(a: int, b: int) -> tuple:
        if rng.random() < 0.2:
            return tuple(tuple(amount() for _ in range(counts[b])) for _ in range(counts[a]))
        # Resharding: free between like shardings, paid between others.
        return tuple(tuple(0.0 if s == t else rng.choice([0.0, rng.uniform(0, 1), rng.uniform(0, 2)])
                           for t in range(counts[b])) for s in range(counts[a]))

    return ops, [Transfer(a, b, matrix(a, b)) for a, b in pairs]


def random_limit(rng: random.Random, ops) -> float | None:
    """No limit, one some plans fit (from exactly the smallest peak up), or one none fits."""
    kind = rng.random()
    if kind < 0.3:
        return None
    least = _least_peak(tuple(ops))[0]
    if kind < 0.4:
        return least - rng.choice([1.0, 0.5])
    most = sum(max(c.resident_bytes for c in op.choices) for op in ops) + max(
        c.working_bytes for op in ops for c in op.choices)
    return least + rng.choice([0.0, rng.random(), rng.random() ** 3]) * (most - least)


def check_plan(solution: ShardingSolution, ops, transfers, limit) -> None:
    assert solution.seconds == plan_seconds(ops, transfers, solution.choices)
    assert solution.peak_bytes == plan_peak_bytes(ops, solution.choices)
    if limit is not None:
        assert solution.peak_bytes <= limit
    assert solution.bound <= solution.seconds


def assert_same_outcome(ops, transfers, limit, **options) -> ShardingSolution | None:
    """solve_sharding finds the optimum enumeration finds, or fails as it does."""
    try:
        expected = exhaustive_sharding(ops, transfers, memory_limit=limit)
    except PlanError as e:
        with pytest.raises(PlanError) as raised:
            solve_sharding(ops, transfers, memory_limit=limit, **options)
        assert str(raised.value) == str(e)
        return None
    got = solve_sharding(ops, transfers, memory_limit=limit, **options)
    check_plan(got, ops, transfers, limit)
    assert got.optimal and got.bound == got.seconds
    assert math.isclose(got.seconds, expected.seconds, rel_tol=1e-9, abs_tol=0.0), (got, expected)
    return got


@pytest.mark.parametrize("seed", range(70))
def test_random_graphs_match_enumeration(seed):
    rng = random.Random(seed)
    ops, transfers = random_problem(rng)
    limit = random_limit(rng, ops)
    got = assert_same_outcome(ops, transfers, limit)
    if got is not None and seed % 3 == 0:
        # Any previous plan, even one that no longer fits, is only a starting point.
        hint = [rng.randrange(len(op.choices)) for op in ops]
        again = solve_sharding(ops, transfers, memory_limit=limit, hint=hint)
        assert again.optimal and math.isclose(again.seconds, got.seconds, rel_tol=1e-9, abs_tol=0.0)


@pytest.mark.parametrize("seed", range(25))
def test_the_solver_model_matches_enumeration_without_dropping_dominated_choices(seed, monkeypatch):
    # Presolve leaves little of a small graph; without it the solver sees every choice.
    # With no tolerance, time units are rescaled whenever the solver's plan costs less than
    # half the starting plan.
    monkeypatch.setattr(sharding._Reduced, "_drop_dominated", lambda self, i: False)
    monkeypatch.setattr(sharding, "_TOLERANCE", 0.0)
    rng = random.Random(500 + seed)
    ops, transfers = random_problem(rng)
    assert_same_outcome(ops, transfers, random_limit(rng, ops))


@pytest.mark.parametrize("seed", range(20))
def test_coarse_memory_units_still_give_the_exact_optimum(seed, monkeypatch):
    # Fractional byte counts in units of a 256th of the largest peak: the solver's model
    # admits plans that exceed the limit by less than the rounding, which must not come back.
    monkeypatch.setattr(sharding, "_MEMORY_UNITS", 256.0)
    rng = random.Random(700 + seed)
    ops, transfers = random_problem(rng)
    ops = [Operation(op.name, tuple(Choice(c.label, c.seconds, c.resident_bytes + rng.random(),
                                           c.working_bytes + rng.random()) for c in op.choices)) for op in ops]
    assert_same_outcome(ops, transfers, random_limit(rng, ops))


def test_the_random_graphs_exercise_both_dynamic_programming_and_cp_sat():
    methods = set()
    for seed in range(70):
        rng = random.Random(seed)
        ops, transfers = random_problem(rng)
        limit = random_limit(rng, ops)
        try:
            methods.add(solve_sharding(ops, transfers, memory_limit=limit).method)
        except PlanError:
            pass
    assert methods == {"dp", "cp-sat"}


@pytest.mark.parametrize("seed", range(25))
def test_forests_without_a_limit_use_dynamic_programming_and_match_enumeration(seed):
    rng = random.Random(1000 + seed)
    ops, transfers = random_problem(rng, tree=True)
    got = assert_same_outcome(ops, transfers, None)
    assert got.method == "dp"


def triangle():
    """Three operations that prefer different shardings, joined in a cycle whose transfers
    are free only between like shardings: no choice dominates, and it is no tree."""
    ops = [Operation(f"op{i}", (Choice("a", 0.1 * i, 0.0, 0.0), Choice("b", 0.3 - 0.1 * i, 0.0, 0.0)))
           for i in range(3)]
    potts = ((0.0, 0.25), (0.25, 0.0))
    return ops, [Transfer(0, 1, potts), Transfer(1, 2, potts), Transfer(2, 0, potts)]


def test_a_frustrated_triangle_is_solved_exactly_by_cp_sat():
    ops, transfers = triangle()
    got = assert_same_outcome(ops, transfers, None)
    assert got.method == "cp-sat"
    assert got.seconds == pytest.approx(0.3)


def test_plan_time_and_peak_follow_the_cost_and_memory_models():
    ops = [Operation("matmul", (Choice("replicated", 2.0, 100.0, 40.0), Choice("sharded", 1.0, 25.0, 10.0))),
           Operation("add", (Choice("replicated", 0.5, 0.0, 30.0), Choice("sharded", 0.25, 0.0, 8.0)))]
    transfers = [Transfer(0, 1, ((0.0, 0.1), (0.7, 0.0)))]
    assert plan_seconds(ops, transfers, (1, 0)) == 1.0 + 0.5 + 0.7
    # Resident bytes of both plus the largest working bytes.
    assert plan_peak_bytes(ops, (1, 0)) == 25.0 + 0.0 + 30.0
    assert plan_peak_bytes(ops, (0, 1)) == 100.0 + 40.0


def test_smallest_peak_matches_enumeration():
    for seed in range(30):
        ops, _ = random_problem(random.Random(2000 + seed), max_ops=7)
        plans = itertools.product(*(range(len(op.choices)) for op in ops))
        least, plan = _least_peak(tuple(ops))
        assert least == min(plan_peak_bytes(ops, p) for p in plans)
        assert plan_peak_bytes(ops, plan) == least


def test_no_plan_fits_names_the_smallest_peak_and_what_to_do():
    ops = [Operation("a", (Choice("x", 1.0, 10.0, 5.0), Choice("y", 1.0, 4.0, 20.0))),
           Operation("b", (Choice("x", 1.0, 3.0, 7.0), Choice("y", 1.0, 6.0, 1.0)))]
    transfers = [Transfer(0, 1, ((0.0, 1.0), (1.0, 0.0)))]
    # Peaks: 10 + 3 + 7 = 20, 10 + 6 + 5 = 21, 4 + 3 + 20 = 27, 4 + 6 + 20 = 30.
    for solve in (solve_sharding, exhaustive_sharding):
        with pytest.raises(PlanError, match=r"memory_limit=19 bytes.*smallest peak any plan reaches is 20 bytes.*"
                                            r"raise memory_limit.*more devices"):
            solve(ops, transfers, memory_limit=19.0)
    assert solve_sharding(ops, transfers, memory_limit=20.0).choices == (0, 0)


def chain_with_residuals(n: int, k: int, seed: int):
    """A transformer-like graph: ``n`` operations in a chain, every third one also reading
    the output of the one four back (a residual), each with ``k`` shardings. Compute times
    and memory vary by sharding; resharding is free between like shardings and costs 0.5,
    1 or 2 times the bytes moved otherwise."""
    rng = random.Random(seed)
    factor = [[0.0 if s == t else rng.choice([0.5, 1.0, 2.0]) for t in range(k)] for s in range(k)]
    ops = []
    for i in range(n):
        base = rng.uniform(1e-4, 1e-3)
        ops.append(Operation(f"op{i}", tuple(
            Choice(f"s{s}", base * rng.uniform(0.3, 1.5) + (rng.uniform(0, 2e-4) if rng.random() < 0.3 else 0.0),
                   float(rng.randrange(1, 1 << 20)), float(rng.randrange(1, 1 << 22))) for s in range(k))))
    transfers = []
    for i in range(1, n):
        for j in [i - 1] + ([i - 4] if i % 3 == 0 and i >= 4 else []):
            nbytes = rng.uniform(1e-5, 1e-4)
            transfers.append(Transfer(j, i, tuple(tuple(nbytes * factor[s][t] for t in range(k)) for s in range(k))))
    return ops, transfers


def test_a_150_operation_chain_with_residuals_solves_to_proven_optimality():
    ops, transfers = chain_with_residuals(150, 16, seed=0)
    got = solve_sharding(ops, transfers, time_limit=60.0)
    assert got.optimal and got.method == "cp-sat"
    check_plan(got, ops, transfers, None)


def test_a_150_operation_chain_with_residuals_under_a_memory_limit_solves_to_proven_optimality():
    ops, transfers = chain_with_residuals(150, 16, seed=0)
    least = _least_peak(tuple(ops))[0]
    free = solve_sharding(ops, transfers)
    limit = least + 0.3 * (free.peak_bytes - least)  # the fastest plan does not fit
    got = solve_sharding(ops, transfers, memory_limit=limit, time_limit=60.0)
    assert got.optimal and got.seconds > free.seconds
    check_plan(got, ops, transfers, limit)


def test_a_short_time_limit_returns_the_best_plan_found_and_a_proven_bound():
    ops, transfers = chain_with_residuals(150, 16, seed=0)
    least = _least_peak(tuple(ops))[0]
    limit = least + 0.1 * (sum(max(c.resident_bytes for c in op.choices) for op in ops) - least)
    got = solve_sharding(ops, transfers, memory_limit=limit, time_limit=0.01)
    check_plan(got, ops, transfers, limit)
    assert got.optimal or got.bound < got.seconds


def test_a_hinted_re_plan_after_a_change_finds_the_same_optimum():
    ops, transfers = chain_with_residuals(40, 8, seed=1)
    before = solve_sharding(ops, transfers)
    # A slice change: one operation gets slower in its current sharding.
    i, k = 17, before.choices[17]
    slower = list(ops[i].choices)
    slower[k] = dataclasses.replace(slower[k], seconds=slower[k].seconds * 3)
    changed = ops[:i] + [Operation(ops[i].name, tuple(slower))] + ops[i + 1:]
    fresh = solve_sharding(changed, transfers)
    hinted = solve_sharding(changed, transfers, hint=before.choices)
    assert fresh.optimal and hinted.optimal and hinted.method == "cp-sat"
    assert math.isclose(hinted.seconds, fresh.seconds, rel_tol=1e-9, abs_tol=0.0)
    # The optimum itself as hint comes straight back.
    assert solve_sharding(changed, transfers, hint=hinted.choices).seconds == hinted.seconds


def test_exhaustive_refuses_too_many_plans():
    ops = [Operation(f"op{i}", tuple(Choice(f"c{k}", 1.0, 0.0, 0.0) for k in range(4))) for i in range(11)]
    with pytest.raises(PlanError, match="4,194,304 plans"):
        exhaustive_sharding(ops, [])


def test_an_empty_graph_has_the_empty_plan():
    got = solve_sharding([], [])
    assert got.choices == () and got.seconds == 0.0 and got.peak_bytes == 0.0 and got.optimal


def odd_cycle():
    """Three operations whose transfers cost only between like shardings: any spanning tree
    of the cycle can avoid them, the cycle cannot, so only the search proves the optimum."""
    ops = [Operation(f"op{i}", (Choice("a", 0.0, 0.0, 0.0), Choice("b", 0.0, 0.0, 0.0))) for i in range(3)]
    unlike = ((0.25, 0.0), (0.0, 0.25))
    return ops, [Transfer(0, 1, unlike), Transfer(1, 2, unlike), Transfer(2, 0, unlike)]


def test_an_odd_cycle_is_proven_by_the_search():
    ops, transfers = odd_cycle()
    got = assert_same_outcome(ops, transfers, None)
    assert got.method == "cp-sat" and got.optimal and got.seconds == pytest.approx(0.25)


def test_the_search_log_is_shown_on_request(monkeypatch, capfd):
    ops, transfers = odd_cycle()
    monkeypatch.setenv("PATHWAYS_PLAN_LOG", "1")
    solve_sharding(ops, transfers)
    assert "CP-SAT" in capfd.readouterr().out


GOOD = [Operation("a", (Choice("x", 1.0, 1.0, 1.0), Choice("y", 2.0, 1.0, 1.0))),
        Operation("b", (Choice("x", 1.0, 1.0, 1.0),))]


def choice(**fields):
    return Choice(**{"label": "bad", "seconds": 1.0, "resident_bytes": 1.0, "working_bytes": 1.0, **fields})


@pytest.mark.parametrize("ops, transfers, options, message", [
    ([Operation("a", (choice(seconds=math.nan),))], [], {}, r"operation 0 \('a'\) choice 0 \('bad'\) seconds must be"),
    ([Operation("a", (choice(resident_bytes=-1.0),))], [], {}, r"operation 0 \('a'\) choice 0 .* resident_bytes"),
    ([Operation("a", (choice(working_bytes=math.inf),))], [], {}, r"choice 0 \('bad'\) working_bytes must be"),
    ([Operation("a", (choice(seconds="1"),))], [], {}, r"seconds must be a finite number >= 0, got '1'"),
    ([Operation("a", ())], [], {}, r"operation 0 \('a'\) has no choices"),
    (GOOD, [Transfer(0, 1, ((0.0,),))], {}, r"transfer 0 \('a' -> 'b'\) seconds must be a 2 x 1 matrix"),
    (GOOD, [Transfer(0, 1, ((0.0, 1.0), (0.0, 1.0)))], {}, r"transfer 0 \('a' -> 'b'\) seconds must be a 2 x 1"),
    (GOOD, [Transfer(1, 0, ((0.0, -1.0),))], {}, r"transfer 0 \('b' -> 'a'\) seconds\[0\]\[1\] must be"),
    (GOOD, [Transfer(0, 1, ((0.0,), (math.nan,)))], {}, r"transfer 0 .* seconds\[1\]\[0\] must be"),
    (GOOD, [Transfer(0, 2, ((0.0,), (0.0,)))], {}, r"transfer 0 dst must be an operation index in \[0, 2\), got 2"),
    (GOOD, [Transfer(-1, 1, ((0.0,), (0.0,)))], {}, r"transfer 0 src must be an operation index"),
    (GOOD, [Transfer(True, 1, ((0.0,), (0.0,)))], {}, r"transfer 0 src must be an operation index"),
    (GOOD, [Transfer(0, 0, ((0.0, 0.0), (0.0, 0.0)))], {}, r"transfer 0 \('a' -> 'a'\) is a self-loop"),
    (GOOD, [], {"hint": (0,)}, r"hint has 1 entries but there are 2 operations"),
    (GOOD, [], {"hint": (0, 1)}, r"hint\[1\] for operation 1 \('b'\) must be a choice index in \[0, 1\), got 1"),
    (GOOD, [], {"memory_limit": math.nan}, r"memory_limit must be"),
    (GOOD, [], {"memory_limit": -1.0}, r"memory_limit must be"),
    (GOOD, [], {"time_limit": 0}, r"time_limit must be a positive number"),
])
def test_invalid_inputs_are_named(ops, transfers, options, message):
    with pytest.raises(PlanError, match=message):
        solve_sharding(ops, transfers, **options)
