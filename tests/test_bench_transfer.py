"""bench transfer's report from given samples (pure logic; tests/test_bench.py runs it whole)."""

import math

from pathways_bench import transfer

MiB = 1 << 20


def _samples(fixed_s: float, big_s: float, raw_s: float) -> dict[str, dict[int, list[float]]]:
    """Seconds per run: ``fixed_s`` for one float32, ``big_s`` for 16 MiB on every route."""
    cases = {transfer._case(route, tls): {4: [fixed_s], 16 * MiB: [big_s]}
             for route in transfer.ROUTES for tls in (False, True)}
    return {**cases, "raw TCP": {4: [1e-4], 16 * MiB: [raw_s]}}


def test_net_rate_above_raw_tcp_is_not_shown() -> None:
    # 16 MiB takes 5 ms more than the fixed cost, raw TCP 10 ms: a net rate twice raw TCP's is noise
    data = transfer._report(_samples(0.010, 0.015, 0.010), [16 * MiB])
    assert all(math.isnan(r["net"]) for r in data["rows"])
    assert {row[4] for row in transfer.tables(data)[0].rows} == {"-"}
    # 40 ms over the fixed cost: slower than raw TCP, shown
    data = transfer._report(_samples(0.010, 0.050, 0.010), [16 * MiB])
    assert all(r["net"] == 16 * MiB / 0.040 for r in data["rows"])


def test_a_tiny_run_judges_no_target() -> None:
    data = transfer._report(_samples(0.010, 0.015, 0.010), [16 * MiB])  # fixed cost 100x the round trip
    data["meta"] = {"tiny": True}
    lines = transfer.summary(data)
    assert not any("missed" in line or ": met" in line for line in lines), lines
    assert any("not judged" in line for line in lines)
    data["meta"] = {"tiny": False}
    assert any("**missed** by 95.0x" in line for line in transfer.summary(data))
