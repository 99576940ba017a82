"""The benchmarks at tiny sizes, on real clusters, so that they cannot rot."""

import math

from pathways.bench import pipeline, transfer
from tests.conftest import child_pids


def test_transfer_bench_measures_both_routes_and_raw_tcp(capsys):
    before = child_pids()
    sizes = (4096, 2 * 1024 * 1024)  # copied into one write with the header, and sent from the array
    result = transfer.main(rounds=1, sizes=sizes)
    assert child_pids() <= before, "the benchmark left its cluster or socket helpers running"

    rows = result["rows"]
    assert [(r["size"], r["route"]) for r in rows] == [(n, route) for n in sizes for route in transfer.ROUTES]
    for r in rows:
        for key in ("pathways", "min", "max", "raw", "ratio"):
            assert r[key] > 0 and math.isfinite(r[key]), (key, r)
        assert r["min"] <= r["pathways"] <= r["max"]
        assert math.isnan(r["net"]) or r["net"] >= r["pathways"]
    assert set(result["overhead_s"]) == set(transfer.ROUTES) and all(s > 0 for s in result["overhead_s"].values())

    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per row
    assert all(line.count("|") == 7 for line in table)
    assert table[2].startswith("| 4 KiB | same island |") and table[-1].startswith("| 2 MiB | other island |")


def test_pipeline_bench_compares_parallel_and_sequential_dispatch(capsys):
    before = child_pids()
    result = pipeline.main(rounds=1, stages=(1, 2), computations=8)
    assert child_pids() <= before, "the benchmark left its cluster running"
    assert sorted(result) == [1, 2]
    for n, r in result.items():
        for mode in ("parallel", "sequential"):
            low, high = r["spread"][mode]
            assert 0 < low <= r[mode] <= high and math.isfinite(high), (n, mode, r)
    table = capsys.readouterr().out.splitlines()
    assert any(line.split()[:1] == ["2"] and line.endswith("x") for line in table)
