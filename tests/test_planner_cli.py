import io
import json
import os
import re
import shutil

import pytest

from pathways_bench import planner as bench
from pathways_bench.report import Progress
from pathways.planner import Device, Layer, Link, PlanError, Topology, pipeline_partition
from pathways.cli import main as pathways_main
from pathways.planner.gantt import plot_pipeline

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "plans")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main(argv: list[str]) -> int:
    """``pathways plan ARGV...``, in this process."""
    return pathways_main(["plan", *argv])


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC


def test_pipeline_example_prints_the_plan_and_writes_its_gantt_chart(tmp_path, capsys):
    out = tmp_path / "pipe.png"
    assert main(["pipeline", os.path.join(EXAMPLES, "pipeline.json"), "--png", str(out), "--objective",
                 "throughput", "--time-limit", "20"]) == 0
    text = capsys.readouterr().out
    assert "pipeline plan: objective throughput, strategy optimal (proven optimal)" in text
    assert "stage" in text and "device" in text and "microbatches/s" in text and "fits memory: yes" in text
    assert is_png(out)


def test_pipeline_memory_weighted_strategy_is_selectable(tmp_path, capsys):
    out = tmp_path / "exo.png"
    assert main(["pipeline", os.path.join(EXAMPLES, "pipeline.json"), "--png", str(out), "--strategy",
                 "memory_weighted"]) == 0
    assert "strategy memory_weighted (not proven optimal)" in capsys.readouterr().out
    assert is_png(out)


@pytest.mark.parametrize("method", ["heft", "optimal"])
def test_dag_example_prints_the_schedule_and_writes_png_in_the_current_directory_by_default(
        method, tmp_path, capsys, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    path = tmp_path / "in" / "dag.json"
    shutil.copy(os.path.join(EXAMPLES, "dag.json"), path)
    monkeypatch.chdir(tmp_path / "out")
    assert main(["dag", str(path), "--method", method, "--time-limit", "20"]) == 0
    text = capsys.readouterr().out
    assert f"schedule: method {method}" in text and "makespan" in text and "lower bound" in text
    for task in ("load", "embed", "block0", "block1", "aux", "head", "loss", "metrics"):
        assert f"\n{task} " in text
    assert is_png(tmp_path / "out" / "dag.png"), "the chart goes to the current directory"
    assert not (tmp_path / "in" / "dag.png").exists(), "not next to the input"
    assert f"Gantt chart written to {tmp_path / 'out' / 'dag.png'}" in text


def write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


TOPO = {"devices": [{"id": "a", "memory_bytes": 1000, "flops": 1.0}], "default_link": {"latency": 0, "bandwidth": 1}}


@pytest.mark.parametrize("kind, data, match", [
    ("pipeline", TOPO, "missing 'layers'"),
    ("pipeline", {**TOPO, "layers": [{"flops": "many", "param_bytes": 1, "activation_bytes": 1}]},
     r"layers\[0\].flops must be int or float"),
    ("pipeline", {**TOPO, "layers": [{"flops": 1, "param_bytes": 1, "activation_bytes": 1, "repeat": 0}]},
     r"layers\[0\].repeat must be a positive integer"),
    ("pipeline", {"layers": []}, "topology has no 'devices'"),
    ("dag", {**TOPO, "tasks": [{"id": "t", "durations": {"zzz": 1.0}}]}, "unknown device 'zzz'"),
    ("dag", {**TOPO, "tasks": [{"id": "t", "flops": 1.0, "deps": {"u": 1}}]}, "depends on unknown task 'u'"),
    ("dag", {**TOPO, "tasks": [{"id": "t", "flops": 1.0, "eligible": "a"}]}, r"tasks\[0\].eligible must be list"),
    ("dag", {**TOPO, "tasks": {"id": "t"}}, "tasks must be list"),
    ("dag", "{not json", "not valid JSON"),
    ("dag", "[1, 2]", "must hold a JSON object"),
])
def test_bad_files_get_a_one_line_error_and_status_2(kind, data, match, tmp_path, capsys):
    path = write(tmp_path, data)
    assert main([kind, path, "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1
    assert re.search(match, err)
    assert not (tmp_path / "x.png").exists()


def test_a_missing_file_and_bad_options_are_errors(tmp_path, capsys):
    assert main(["dag", str(tmp_path / "nowhere.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["pipeline", os.path.join(EXAMPLES, "pipeline.json"), "--objective", "speed"]) == 2
    assert "invalid choice: 'speed'" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_plot_pipeline_rejects_a_bad_microbatch_count(tmp_path):
    topo = Topology([Device("a", 100, 1.0), Device("b", 100, 1.0)], default_link=Link(0.1, 10.0))
    plan = pipeline_partition(topo, [Layer(1.0, 10, 10)] * 4, "throughput")
    with pytest.raises(PlanError, match="microbatches must be a positive integer"):
        plot_pipeline(plan, topo, str(tmp_path / "p.png"), microbatches=0)
    plot_pipeline(plan, topo, str(tmp_path / "p.png"), microbatches=1)
    assert is_png(tmp_path / "p.png")


def test_benchmark_tiny_run_produces_tables_summary_and_plot(tmp_path):
    data = bench.measure(rounds=1, tiny=True, progress=Progress("t", stream=io.StringIO()))
    assert json.loads(json.dumps(data)) == data
    tables = bench.tables(data)
    assert len(tables) == 4 and all(t.rows for t in tables)
    assert {r[0] for r in tables[3].rows} == set(bench.CHANGES)
    lines = bench.summary(data)
    assert any(line.startswith("Pipelines, latency") for line in lines)
    assert any("Re-planning from the previous schedule" in line for line in lines)
    assert bench.notes(data).strip()
    bench.plot(data, str(tmp_path / "planner.png"))
    assert is_png(tmp_path / "planner.png")


def test_dag_chart_draws_transfers_with_their_time_and_names_narrow_tasks(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from pathways.planner import Task, schedule
    from pathways.planner.gantt import plot_schedule, transfers

    topo = Topology([Device("a", 1 << 30, 1e12), Device("b", 1 << 30, 1e12)],
                    default_link=Link(latency=0.0, bandwidth=1e6))
    tasks = [Task("load", durations={"a": 1.0}), Task("tiny", durations={"a": 0.001}, deps={"load": 0}),
             Task("train", durations={"b": 1.0}, deps={"load": 500_000})]  # 0.5 s over the link
    plan = schedule(tasks, topo, "heft")
    assert transfers(plan) == [("load", "train", 1.0, 1.5)]
    assert plan.placements["train"].start >= 1.5
    drawn = {}
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):  # what the chart holds, read just before it is written
        ax = fig.axes[0]
        drawn["texts"] = [t.get_text() for t in ax.texts]
        drawn["hatched"] = [c for c in ax.collections if c.get_hatch()]
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_schedule(plan, str(tmp_path / "dag.png"))
    assert is_png(tmp_path / "dag.png")
    assert "500 ms" in drawn["texts"], drawn["texts"]  # the transfer, labelled with its time
    assert len(drawn["hatched"]) == 1
    assert {"load", "tiny", "train"} <= set(drawn["texts"]), "every task is named, the narrow one too"
