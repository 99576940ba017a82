"""Every benchmark at its tiny size, through the command line, on real clusters, so that none
can rot: each must print its tables, write JSON with sane numbers and a PNG, and leave no
process behind."""

import json
import math

import pytest

from pathways.__main__ import main
from pathways_bench import netns, parity, report, suite
from tests.conftest import child_pids

PNG = b"\x89PNG\r\n\x1a\n"


def rate_ok(s):
    return 0 < s["min"] <= s["median"] <= s["max"] and math.isfinite(s["max"])


def check_dispatch(d):
    assert d["hosts"] == [1, 2]
    for h in ("1", "2"):
        assert set(d["rates"][h]) == {"JAX-O", "JAX-F", "PW-O", "PW-C", "PW-C fused", "PW-F"}
        assert all(rate_ok(s) for s in d["rates"][h].values())


def check_parity(d):
    assert d["hosts"] == [1, 2] and len(d["durations_ms"]) == 2
    assert all(k >= 1 for k in d["steps"].values())
    for h in ("1", "2"):
        for ms in d["durations_ms"]:
            assert rate_ok(d["rates"][h][str(ms)]["PW-O"]) and rate_ok(d["rates"][h][str(ms)]["JAX-O"])
        point = parity.parity_point(d["durations_ms"], d["rates"][h])
        assert point is None or point in d["durations_ms"]


def check_pipeline(d):
    assert d["stages"] == [1, 2]
    assert all(rate_ok(d["rates"][n][m]) for n in ("1", "2") for m in ("parallel", "sequential"))
    assert list(d["overhead"]) == ["128-node chain, 1 host", "2-stage pipeline"]
    assert all(rate_ok(r[m]) for r in d["overhead"].values() for m in ("untraced", "traced"))
    hops = d["hops"]
    assert hops["stages"] == 2 and rate_ok(hops["hop_us"]) and rate_ok(hops["raw_us"])
    steps = {(where, name) for where, name, *_ in hops["steps"]}
    assert {("client", "submit"), ("controller", "dispatch"), ("worker", "execute")} <= steps, steps


def check_transfer(d):
    assert [(r["size"], r["route"], r["tls"]) for r in d["rows"]] == [
        (n, route, tls) for n in (4096, 2 << 20) for route in ("same island", "other island") for tls in (False, True)]
    for r in d["rows"]:
        assert 0 < r["min"] <= r["pathways"] <= r["max"] and r["raw"] > 0 and r["ratio"] > 0
    assert len(d["overhead_s"]) == 4 and all(s > 0 for s in d["overhead_s"].values())
    across = d["netns"]  # measured across network namespaces where they can be made, else why not
    reason = netns.unavailable()
    if reason:
        assert across == {"skipped": reason}
    else:
        columns = ["pathways", "pathways TLS"]
        assert [r["size"] for r in across["rows"]] == [4096, 2 << 20] and across["columns"] == columns
        for r in across["rows"]:
            assert all(rate_ok(s) for s in r["rates"].values()) and set(r["rates"]) == {*columns, "raw TCP"}
            assert all(r["ratios"][c] > 0 for c in columns)
        assert all(s > 0 for s in across["round_trip_s"].values())


def check_tenancy(d):
    assert d["clients"] == [1, 2]
    assert all(rate_ok(d["rates"][c][k]) for c in ("small", "large") for k in ("1", "2"))
    assert set(d["shares"]) == {"1:1:1:1", "1:2:4:8"}
    for label, r in d["shares"].items():
        assert r["weights"] == [int(w) for w in label.split(":")]
        assert all(s > 0 for s in r["device_seconds"]) and all(c > 0 for c in r["completed"])


def check_clients(d):
    assert d["clients"] == [2, 10]
    for n in ("2", "10"):
        [r] = d["results"][n]
        assert r["rate"] > 0 and r["rounds"] > 0 and 0 < r["p50"] <= r["p99"] and r["latencies"] > 0


def check_train(d):
    assert set(d["rates"]) == {"GPipe, pathways", "data parallel, pathways", "data parallel, JAX"}
    assert all(rate_ok(s) for s in d["rates"].values())
    # The same model, batches and initial parameters: the same losses in every mode.
    assert all(v <= 1e-5 for v in d["losses"]["max_difference_vs_jax"].values()), d["losses"]
    assert d["losses"]["last"] < d["losses"]["first"]


def check_planner(d):
    assert d  # its numbers are checked by tests/test_planner_cli.py


def check_control(d):
    assert d["transports"] == ["sync gRPC", "aio gRPC", "framed TCP"]
    for figure in ("ping_cpu_us", "burst_cpu_us", "ping_server_us", "burst_server_us", "round_trip_us"):
        assert set(d[figure]) == set(d["transports"])
    # CPU is counted in clock ticks: a tiny sample may round to zero, never below it
    assert all(s["min"] >= 0 and math.isfinite(s["max"]) for f in ("ping_cpu_us", "burst_cpu_us")
               for s in d[f].values())
    assert all(rate_ok(s) for s in d["round_trip_us"].values())


def check_ifrt(d):
    assert d["sizes"] == [1024, 1 << 20]
    assert set(d["jit"]) == {"pipelined", "blocking", "read"}
    assert all(rate_ok(s) for mode in d["jit"].values() for s in mode.values())
    assert all(set(m) == {"proxy", "local", "native"} for m in d["jit"].values())
    for direction in ("device_put", "np.asarray"):
        assert set(d["transfers"][direction]) == {"1024", str(1 << 20)}
        assert all(set(size) == {"proxy", "local", "native", "grpc", "raw"} and all(rate_ok(s) for s in size.values())
                   for size in d["transfers"][direction].values())
    assert set(d["train_seconds"]) == {"local", "proxy 1x4", "proxy 2x2"}
    assert all(rate_ok(s) for s in d["train_seconds"].values())
    # the same model, parameters and batches, data parallel on four devices, through the
    # proxy on either island and on local JAX
    assert d["losses"]["steps"] == 3 and set(d["losses"]["max_difference"]) == {"proxy 1x4", "proxy 2x2"}
    assert all(x <= 1e-5 for x in d["losses"]["max_difference"].values()), d["losses"]
    # the load average at the round's start, as os.getloadavg gave it (one round at --tiny)
    assert d["load"]["n"] == 1 and d["load"]["min"] == d["load"]["median"] == d["load"]["max"] >= 0, d["load"]


def check_elastic(d):
    assert all(0 < d[k]["median"] < 120 for k in ("heal_s", "fresh_s")), d
    assert all(d["suspend"][k] > 0 for k in ("suspend_s", "resume_s", "numpy_copy_s", "transfer_s")), d["suspend"]
    chaos = d["chaos"]
    assert chaos["failures"] == [] and chaos["healed_after_s"] is not None and chaos["leaked"] == {}, chaos


def check_assembly(d):
    for case in ("loopback", "warm"):
        assert 0 < d[case]["assembled"]["median"] <= d[case]["serving"]["median"] < 120, d
        assert d[case]["cpu"]["median"] > 0, d
    netns = d["netns"]
    assert "skipped" in netns or 0 < netns["assembled"]["median"] <= netns["serving"]["median"] < 120, d


def check_conduct(d):
    from pathways_bench import conduct

    assert d["versions"] == list(conduct.VERSIONS)
    assert set(d["step_seconds"]) == set(conduct.VERSIONS) and all(rate_ok(s) for s in d["step_seconds"].values())
    assert set(d["ratios"]) == set(conduct.BASELINES)
    assert all(r > 0 and math.isfinite(r) for r in d["ratios"].values())
    best = min(conduct.BASELINES, key=lambda b: d["step_seconds"][b]["median"])
    assert d["best_baseline"] == best and d["ratio_to_best"] == d["ratios"][best]
    # the same gradient as plain JAX, whichever way it is sharded
    assert set(d["max_gradient_error"]) == set(conduct.VERSIONS)
    assert all(e <= 1e-5 for e in d["max_gradient_error"].values()), d["max_gradient_error"]
    assert set(d["targets"]) == {"step", "replan"}
    r = d["replan"]
    assert len(r["warm"]) == len(r["cold"]) == d["meta"]["rounds"]
    for p in [d["plan"], *r["warm"], *r["cold"]]:
        assert math.prod(p["mesh"].values()) == d["size"]["devices"], p
        assert p["predicted_seconds"] > 0 and 0 < p["solve_seconds"] <= p["planning_seconds"], p
        assert isinstance(p["optimal"], bool) and isinstance(p["ring_attention"], bool), p
        assert isinstance(p["attention_split"], str) and p["attention_split"], p
        assert p["gap"] == 0 if p["optimal"] else p["gap"] >= 0, p
    # a re-plan starts from the previous plan (its solution on each mesh shape); a cold plan never does
    assert all(w["hinted"] for w in r["warm"]) and not any(c["hinted"] for c in r["cold"])
    assert r["hinted"]
    assert all(rate_ok(r[k][mode]) for k in ("planning_seconds", "solve_seconds") for mode in ("warm", "cold"))
    assert r["ratio"] == r["planning_seconds"]["warm"]["median"] / r["planning_seconds"]["cold"]["median"]
    assert r["all_optimal"] == all(p["optimal"] for p in r["warm"] + r["cold"])
    gaps = [abs(w["predicted_seconds"] / c["predicted_seconds"] - 1) for w, c in zip(r["warm"], r["cold"])]
    assert math.isclose(r["cost_gap"], max(gaps), rel_tol=1e-6, abs_tol=1e-12), (r["cost_gap"], gaps)
    if r["all_optimal"]:
        assert r["same_cost"], "re-planning found a costlier plan than planning from scratch"
    assert isinstance(r["plan_changed"], bool) and r["flops_scale"] > 0


def check_checkpoint(d):
    from pathways_bench import checkpoint

    assert d["bytes"] == checkpoint.TINY_SIZE
    assert set(d["cases"]) == {"pw.save", "one writer", "two writers", "pw.load", "one reader"}
    assert all(rate_ok(s) for s in d["cases"].values())
    # the rates are the bytes over the median seconds of the same samples
    assert all(math.isclose(d["cases"][k]["median"], d["bytes"] / d["seconds"][k] / 1e6, rel_tol=1e-9)
               for k in d["cases"]), d


CHECKS = {name: globals()[f"check_{name}"] for name in suite.EXPERIMENTS}


def check_tiny_run(name, out_json, out_png, printed):
    """What `bench NAME --tiny --json OUT_JSON --plot OUT_PNG` must leave: its JSON with sane
    numbers, a PNG, and its tables and summary in ``printed`` (its stdout)."""
    data = json.loads(out_json.read_text())
    assert data["meta"]["name"] == name and data["meta"]["tiny"] and data["meta"]["rounds"] == 1
    CHECKS[name](data)
    assert out_png.read_bytes().startswith(PNG)
    module = suite.module(name)
    for table in module.tables(data):
        assert table.title in printed and len(table.rows) > 0
    for line in module.summary(data):
        assert line in printed


# dispatch runs through the command line in tests/test_terminal.py, which checks the same
@pytest.mark.soak  # each benchmark starts clusters of its own: minutes in all
@pytest.mark.parametrize("name", [name for name in suite.EXPERIMENTS if name != "dispatch"])
def test_benchmark_runs_at_a_tiny_size(name, tmp_path, capsys):
    before = child_pids()
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    assert main(["bench", name, "--tiny", "--json", str(out_json), "--plot", str(out_png)]) == 0
    assert child_pids() <= before, f"bench {name} left processes running"
    check_tiny_run(name, out_json, out_png, capsys.readouterr().out)


@pytest.mark.soak
def test_bench_all_writes_a_markdown_section_per_experiment(tmp_path):
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "all.json"
    suite.run_all(tiny=True, out=str(out), plots=str(tmp_path / "plots"), json_path=str(data), only=("planner",))
    text = out.read_text()
    again = tmp_path / "again.md"
    assert main(["bench", "all", "--from-json", str(data), "--out", str(again), "--plots",
                 str(tmp_path / "plots")]) == 0
    assert again.read_text() == text, "redrawing from the JSON should give the same document"
    module = suite.module("planner")
    assert text.startswith("# Benchmarks") and f"## {module.TITLE}" in text
    assert "python -m pathways bench planner --rounds 1" in text
    assert "![planner](plots/planner.png)" in text
    assert (tmp_path / "plots" / "planner.png").read_bytes().startswith(PNG)


def test_parity_point_needs_the_ratio_to_stay_at_parity():
    def rates(ratios):
        return {str(d): {"PW-O": {"median": r}, "JAX-O": {"median": 1.0}} for d, r in zip(range(len(ratios)), ratios)}

    durations = list(range(6))
    assert parity.parity_point(durations, rates([0.5, 0.96, 0.7, 0.8, 0.96, 1.0])) == 4  # 0.96 at 1 did not last
    assert parity.parity_point(durations, rates([0.5, 0.96, 0.97, 1.0, 0.92, 1.0])) == 1  # noise, not a dip
    assert parity.parity_point(durations, rates([0.5, 0.96, 0.7, 0.8, 0.96, 1.0]), sustained=False) == 1
    assert parity.parity_point(durations, rates([0.5] * 6)) is None


def test_progress_and_tables_render():
    class Sink:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    sink = Sink()
    p = report.Progress("x", stream=sink)
    p.expect(20)
    for i in range(20):
        p.step(f"case {i}")
    # Off a terminal: a line for the first step, then one per tenth.
    assert sink.text.count("\n") == 11 and "20/20" in sink.text
    t = report.Table("t", ["a", "b"], [["1", "22"], ["333", "4"]])
    assert t.markdown().splitlines()[2:] == ["| a | b |", "| --- | ---: |", "| 1 | 22 |", "| 333 | 4 |"]
    assert t.text().splitlines()[1:] == ["a     b", "---  --", "1    22", "333   4"]
    assert report.stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
