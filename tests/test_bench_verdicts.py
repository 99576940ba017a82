"""Benchmark summaries judge their targets on full runs only (pure logic, from given figures:
tests/test_bench.py runs the benchmarks whole)."""

import re

import pytest

from pathways_bench import assembly, conduct, dispatch, parity, pipeline
from pathways_bench.report import stats

VERDICT = re.compile(r"\b(met|missed)\b")


def _rates(**rates: float) -> dict:
    return {mode: stats([rate]) for mode, rate in rates.items()}


# Figures that miss every target, so that a judged summary says so.
MISSING = {
    dispatch: {"hosts": [1, 2],
               "rates": {h: _rates(**{"JAX-O": 1000, "JAX-F": 1000, "PW-O": 100, "PW-C": 100, "PW-F": 100})
                         for h in ("1", "2")}},
    pipeline: {"stages": [1, 4], "rates": {n: _rates(parallel=100, sequential=100) for n in ("1", "4")}},
    parity: {"hosts": [1], "durations_ms": [0.1, 1.0],
             "rates": {"1": {d: _rates(**{"PW-O": 1, "JAX-O": 10}) for d in ("0.1", "1.0")}}},
    assembly: {"loopback": {"assembled": stats([10.0]), "serving": stats([11.0])}, "netns": {"skipped": "no root"}},
    conduct: {"best_baseline": "data parallel", "ratio_to_best": 2.0, "targets": {"step": 1.05, "replan": 0.2},
              "replan": {"ratio": 0.9, "planning_seconds": {"warm": stats([0.9]), "cold": stats([1.0])},
                         "hinted": True, "same_cost": True, "cost_gap": 0.0, "all_optimal": True,
                         "plan_changed": False}},
}


@pytest.mark.parametrize("module", MISSING, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_only_a_full_run_judges_the_targets(module) -> None:
    tiny = module.summary({**MISSING[module], "meta": {"tiny": True}})
    assert tiny[0].startswith("targets not judged"), tiny
    assert not any(VERDICT.search(line) for line in tiny), tiny
    # without "meta", as a module's own figures are before the suite adds it: a full run
    for data in ({**MISSING[module], "meta": {"tiny": False}}, MISSING[module]):
        full = module.summary(data)
        assert not any("not judged" in line for line in full), full
        assert any("missed" in line for line in full), full
