"""``pathways plan``: plan a pipeline partition or a DAG schedule from a JSON file.

Plan a pipeline (`plan pipeline FILE.json`) or a task graph (`plan dag FILE.json`) from a JSON
file: print the plan as a table and draw its Gantt chart.

Both kinds of file hold a topology (the form of Topology.to_dict):

    "devices": [{"id": "0", "memory_bytes": 17179869184, "flops": 1e14, "kind": "gpu"}, ...],
    "links": [{"src": "0", "dst": "1", "latency": 5e-06, "bandwidth": 2.5e10}, ...],
    "default_link": {"latency": 5e-05, "bandwidth": 1.25e9}        (optional)

(a link given once serves both directions; "default_link" serves unlisted pairs), an optional
"about" string that is ignored, and then, for a pipeline, its layers:

    "layers": [{"flops": F, "param_bytes": P, "activation_bytes": A, "repeat": R}, ...]

where "activation_bytes" is the size of the layer's output and the optional "repeat" (default
1) stands for that many identical layers in a row; for a task graph, its tasks:

    "tasks": [{"id": "a", "durations": {"0": 0.5, ...} or "flops": F, "memory_bytes": M,
               "eligible": ["0", ...], "deps": {"b": nbytes, ...}}, ...]

where "durations" (seconds per device) or "flops" is required and the rest is optional;
"deps" maps a predecessor's id to the bytes it sends to this task.

See examples/plans/pipeline.json and examples/plans/dag.json. A file that does not follow this
format gets a one-line error on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pathways.planner.partition import OBJECTIVES, STRATEGIES, Layer, PipelinePlan, pipeline_partition
from pathways.planner.schedule import METHODS, Schedule, Task, schedule
from pathways.planner.topology import PlanError, Topology, _field, _objects
from pathways.table import Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", required=True, metavar="pipeline|dag")
    pipe = sub.add_parser("pipeline", help="split a model's layers over the devices as a ring pipeline",
                          description="Split a model's layers over the devices of a topology as a ring "
                                      "pipeline (JSON: topology and layers); prints the plan and draws its Gantt "
                                      "chart.")
    pipe.add_argument("file", help="JSON file: topology and layers")
    pipe.add_argument("--objective", choices=OBJECTIVES, default="latency",
                      help="minimize one token's time through the ring (latency), or maximize microbatches "
                           "per second (throughput, the slowest stage)")
    pipe.add_argument("--strategy", choices=STRATEGIES, default="optimal",
                      help="optimal: exact (CP-SAT); memory_weighted: exo's layers in proportion to memory")
    pipe.add_argument("--microbatches", type=int, default=4, help="microbatches drawn in the Gantt chart (default 4)")
    dag = sub.add_parser("dag", help="schedule a task graph on the devices",
                         description="Schedule a task graph on the devices of a topology (JSON: topology and "
                                     "tasks); prints the schedule and draws its Gantt chart.")
    dag.add_argument("file", help="JSON file: topology and tasks")
    dag.add_argument("--method", choices=METHODS, default="heft",
                     help="heft: the list-scheduling heuristic; optimal: exact (CP-SAT) within --time-limit")
    for p in (pipe, dag):
        p.add_argument("--png", help="where to write the Gantt chart (default: FILE's name with .png, in the "
                                     "current directory)")
        p.add_argument("--time-limit", type=float, default=10.0,
                       help="seconds the optimal solver may take (default 10)")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Plan, print the plan and write its chart; the exit status (2 for a bad file)."""
    # By default in the current directory, not next to the input (which may be the package's examples).
    png = args.png or os.path.splitext(os.path.basename(args.file))[0] + ".png"
    try:
        data = _read(args.file)
        topology = Topology.from_dict({k: v for k, v in data.items() if k in ("devices", "links", "default_link")})
        if args.kind == "pipeline":
            layers = _layers(data)
            plan = pipeline_partition(topology, layers, args.objective, args.strategy, time_limit=args.time_limit)
            print(_pipeline_text(plan, topology))
            from pathways.planner.gantt import plot_pipeline
            plot_pipeline(plan, topology, png, microbatches=args.microbatches)
        else:
            tasks = _tasks(data)
            result = schedule(tasks, topology, args.method, time_limit=args.time_limit)
            print(_schedule_text(result))
            from pathways.planner.gantt import plot_schedule
            plot_schedule(result, png)
    except PlanError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 2
    print(f"Gantt chart written to {os.path.abspath(png)}")
    return 0


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise PlanError(f"cannot read it: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"the file must hold a JSON object, got {type(data).__name__}")
    return data


def _layers(data: dict) -> list[Layer]:
    layers = []
    for where, item in _objects(_field(data, "layers", list, ""), "layers"):
        repeat = item.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise PlanError(f"{where}.repeat must be a positive integer, got {repeat!r}")
        layer = Layer(flops=_field(item, "flops", (int, float), where),
                      param_bytes=_field(item, "param_bytes", int, where),
                      activation_bytes=_field(item, "activation_bytes", int, where))
        layers += [layer] * repeat
    return layers


def _tasks(data: dict) -> list[Task]:
    tasks = []
    for where, item in _objects(_field(data, "tasks", list, ""), "tasks"):
        durations = _optional(item, "durations", dict, where)
        eligible = _optional(item, "eligible", list, where)
        if eligible is not None and not all(isinstance(d, str) for d in eligible):
            raise PlanError(f"{where}.eligible must be a list of device ids (strings), got {eligible!r}")
        tasks.append(Task(id=_field(item, "id", str, where), durations=durations,
                          flops=_optional(item, "flops", (int, float), where),
                          memory_bytes=item.get("memory_bytes", 0),
                          eligible=None if eligible is None else frozenset(eligible),
                          deps=_optional(item, "deps", dict, where) or {}))
    return tasks


def _optional(item: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    return _field(item, key, types, where) if key in item else None


def _seconds(x: float) -> str:
    for factor, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "us")):
        if abs(x) * factor >= 1.0:
            return f"{x * factor:.4g} {unit}"
    return f"{x * 1e9:.4g} ns"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _pipeline_text(plan: PipelinePlan, topology: Topology) -> str:

    rows = [[str(k), st.device, f"{st.start}-{st.end - 1}", _seconds(st.compute_s), _seconds(st.send_s),
             _mib(st.memory_bytes), _mib(topology.device(st.device).memory_bytes)]
            for k, st in enumerate(plan.stages)]
    proof = "proven optimal" if plan.optimal else "not proven optimal"
    table = Table(f"pipeline plan: objective {plan.objective}, strategy {plan.strategy} ({proof})",
                  ["stage", "device", "layers", "compute", "send", "memory MiB", "device MiB"], rows)
    bound = (f"lower bound {_seconds(plan.bound)}" if plan.objective == "latency"
             else f"upper bound {plan.bound:.4g} microbatches/s")
    return (f"{table.text()}\n"
            f"latency {_seconds(plan.latency)} per token; throughput {plan.throughput:.4g} microbatches/s; "
            f"{bound}; fits memory: {'yes' if plan.fits_memory else 'NO'}")


def _schedule_text(result: Schedule) -> str:

    rows = [[p.task, p.device, _seconds(p.start), _seconds(p.end), _seconds(p.end - p.start)]
            for p in sorted(result.placements.values(), key=lambda p: (p.start, p.device, p.task))]
    table = Table(f"schedule: method {result.method}", ["task", "device", "start", "end", "duration"], rows)
    return (f"{table.text()}\n"
            f"makespan {_seconds(result.makespan)}; lower bound {_seconds(result.lower_bound)}; "
            f"optimal: {'yes' if result.optimal else 'not proven'}; planned in {result.solve_seconds:.3f} s")
