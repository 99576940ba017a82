"""``python -m pathways bench pipeline``: parallel against sequential dispatch (the paper's
Figure 7).

A program chains S small computations (a scalar ``x + 1``), each on a different host
(a one-host island each), for S = 1, 2, 4, 8, 16. The client submits runs back to back,
each reading the previous run's result, as a training loop does, and waits only at the
end. With parallel dispatch every node of a run is at its worker before its input
exists, so a stage costs one worker-to-worker transfer; with sequential dispatch the
controller sends a node only after the node before it finished, so a stage costs a round
trip through the controller as well. The two modes alternate within each round;
computations per second are S x runs / time, medians over rounds.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

import pathways as pw
from pathways import timeline_view
from pathways_bench import report

STAGES = (1, 2, 4, 8, 16)


def _chain(stages: Sequence[pw.Slice], dispatch: str) -> Callable:
    fns = [pw.jit(lambda x: x + 1.0, mesh=s.mesh("d")) for s in stages]
    return _program(fns, dispatch)


def _program(fns: Sequence[Callable], dispatch: str = "parallel") -> Callable:
    """A program calling ``fns`` one after the other."""

    def chain(x):
        for f in fns:
            x = f(x)
        return x

    return pw.program(chain, dispatch=dispatch)


def _timed(program: Callable, first: pw.Slice, runs: int, stages: int) -> float:
    """Computations per second for ``runs`` chained runs of ``program``."""
    x = pw.device_put(np.float32(0), first.devices)
    start = time.perf_counter()
    for _ in range(runs):
        x = program(x)
    value = float(np.asarray(x))
    elapsed = time.perf_counter() - start
    if value != runs * stages:
        raise AssertionError(f"the {stages}-stage chain computed {value}, expected {runs * stages}")
    return runs * stages / elapsed


TITLE = "Pipelines: parallel against sequential dispatch"
PAPER = "Figure 7"
PAPER_RESULT = ("parallel dispatch keeps a pipeline's throughput as stages are added, where sequential "
                "dispatch pays a control round trip per stage")
ROUNDS = 5

ABOUT = """
A program chains S scalar computations (`x + 1`), each on its own host (a one-host island
each), S = 1 to 16. The client submits runs back to back, each reading the previous run's
result, as a training loop does, and waits only at the end. With parallel dispatch every
node of a run is at its worker before its input exists, so a stage costs one
worker-to-worker transfer; with sequential dispatch the controller releases a node only
after the nodes it reads from finished, so a stage also costs a round trip through the
controller. Computations per second = S x runs / time. Target: parallel >= 3x sequential at
16 stages.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    return _measure(rounds, (1, 2) if tiny else STAGES, 8 if tiny else 256, progress)


# The timeline's cost: a chain of this many nodes on one host, and the longest pipeline,
# each traced against untraced.
# Computations per sample of each: enough CPU time that the 10 ms ticks of /proc resolve a
# microsecond per computation.
OVERHEAD_NODES, OVERHEAD_CHAIN, OVERHEAD_PIPELINE = 128, 16384, 2048


def _measure(rounds: int, stages: Sequence[int], computations: int, progress: report.Progress) -> dict:
    """Each chain length; each round runs about ``computations`` computations per mode."""
    hosts = max(stages)
    progress.expect(1 + len(stages) * rounds * 2 + 2 * rounds * 2 + rounds)
    progress.step(f"starting {hosts} one-host islands")
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=1)] * hosts, start_timeout=300.0) as cluster:
        vds = pw.make_virtual_device_set()
        slices = [vds.add_slice(cpu_devices=1, island=i) for i in range(hosts)]
        if len({s.workers for s in slices}) != hosts:
            raise AssertionError("the stages did not land on distinct hosts")
        rates = {}
        for n in stages:
            programs = {mode: _chain(slices[:n], mode) for mode in ("parallel", "sequential")}
            runs = max(computations // n, 4)
            for program in programs.values():  # warm up: compile, first transfers
                _timed(program, slices[0], 2, n)
            cases = {mode: (lambda p=program: _timed(p, slices[0], runs, n)) for mode, program in programs.items()}
            samples = report.alternate(rounds, cases, progress)
            rates[str(n)] = {mode: report.stats(v) for mode, v in samples.items()}
        one = pw.jit(lambda x: x + 1.0, mesh=slices[0].mesh("d"))
        chains = {f"{OVERHEAD_NODES}-node chain, 1 host": (_program([one] * OVERHEAD_NODES), OVERHEAD_NODES,
                                                             OVERHEAD_CHAIN),
                  f"{hosts}-stage pipeline": (programs["parallel"], hosts, OVERHEAD_PIPELINE)}
        pids = [os.getpid(), cluster.pids[0], *cluster.worker_pids()]
        overhead = {what: _overhead(program, slices[0], n, max(total * computations // 256 // n, 4), rounds, pids,
                                    progress)
                    for what, (program, n, total) in chains.items()}
        hops = _stage_hops(programs["parallel"], slices[0], hosts, rounds, progress)
    return {"stages": list(stages), "rates": rates, "overhead": overhead, "hops": hops}


def _stage_hops(program: Callable, first: pw.Slice, stages: int, rounds: int, progress: report.Progress) -> dict:
    """One stage hop of the (warm) ``stages``-stage parallel pipeline against a raw TCP round
    trip of 4 bytes, alternately: each round records one run inside ``pw.trace`` and takes
    the time from the first stage's execute starting to the last one's, per stage; then the
    median of 20 raw round trips between two helper processes. Also where the last recorded
    step's time went, per step."""
    from pathways_bench import transfer  # its raw socket helpers

    x = pw.device_put(np.float32(0), first.devices)
    np.asarray(program(x))  # warm: this input's first transfers
    hop_us, raw_us = [], []
    raw = transfer.Pair(["raw-receive", "4", transfer.LOOPBACK], ["raw-send", "4"])
    try:
        raw.seconds(4, 20)  # warm up
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(rounds):
                path = os.path.join(tmp, f"step{i}.json")
                with pw.trace(path):
                    value = float(np.asarray(program(x)))
                if value != stages:
                    raise AssertionError(f"the traced {stages}-stage step computed {value}, expected {stages}")
                spans = timeline_view.load(path)
                starts = sorted(sp.start_us for sp in spans if sp.name == "execute" and sp.process.startswith("worker"))
                if len(starts) != stages:
                    raise AssertionError(f"the timeline of a {stages}-stage step has {len(starts)} executes")
                hop_us.append((starts[-1] - starts[0]) / max(stages - 1, 1))
                raw_us.append(raw.seconds(4, 20) * 1e6)
                progress.step()
    finally:
        raw.close()
    return {"stages": stages, "hop_us": report.stats(hop_us), "raw_us": report.stats(raw_us),
            "extent_us": timeline_view.extent_us(spans), "steps": [list(row) for row in timeline_view.steps(spans)]}


def _overhead(program: Callable, first: pw.Slice, stages: int, runs: int, rounds: int, pids: list[int],
              progress: report.Progress) -> dict:
    """Computations per second of ``program`` inside ``pw.trace`` and outside, alternately,
    and the CPU time per computation of every process (``pids``: client and cluster). The
    traced figures count recording only: collecting and writing the file come after."""
    cpu: dict[str, list[float]] = {"untraced": [], "traced": []}

    def accounted(mode: str) -> float:
        before = report.cpu_seconds(pids)
        rate = _timed(program, first, runs, stages)
        cpu[mode].append((report.cpu_seconds(pids) - before) * 1e6 / (runs * stages))
        return rate

    with tempfile.TemporaryDirectory() as tmp:
        def traced() -> float:
            with pw.trace(os.path.join(tmp, "bench.json")):
                return accounted("traced")

        traced()  # warm up: compile, first transfers
        cpu["traced"].clear()
        samples = report.alternate(rounds, {"untraced": lambda: accounted("untraced"), "traced": traced}, progress)
    return {**{mode: report.stats(v) for mode, v in samples.items()},
            "cpu_us": {mode: report.stats(v) for mode, v in cpu.items()}}


def tables(data: dict) -> list[report.Table]:
    rows = []
    for n in data["stages"]:
        r = data["rates"][str(n)]
        rows.append([str(n), report.rate(r["parallel"]), report.rate(r["sequential"]),
                     report.times(report.ratio(r["parallel"], r["sequential"]))])
    tables = [report.Table("computations per second, one host per stage, median (min-max)",
                           ["stages", "parallel", "sequential", "parallel/sequential"], rows)]
    if "overhead" in data:
        tables.append(report.Table(
            "timeline overhead: computations per second inside `pw.trace` and outside, alternately",
            ["program", "untraced /s", "traced /s", "CPU us per computation, untraced", "traced", "cost"],
            [[what, report.rate(r["untraced"]), report.rate(r["traced"]), report.rate(r["cpu_us"]["untraced"], 1),
              report.rate(r["cpu_us"]["traced"], 1), _cost(r)] for what, r in data["overhead"].items()]))
    if "hops" in data:
        t = data["hops"]
        tables.append(report.Table(
            f"one stage hop of the {t['stages']}-stage pipeline (from the timeline of one step, first execute "
            "to last, per stage) and a raw TCP round trip of 4 bytes between two processes, alternately; us",
            ["stage hop", "raw TCP round trip", "hop/round trip"],
            [[report.rate(t["hop_us"], 1), report.rate(t["raw_us"], 1),
              report.times(report.ratio(t["hop_us"], t["raw_us"]))]]))
        tables.append(report.Table(
            f"where one step of the {t['stages']}-stage pipeline goes, from its timeline "
            f"({t['extent_us'] / 1000:.2f} ms from first step to last; waits overlap other steps)",
            ["where", "step", "count", "total ms", "median us"],
            [[where, name, str(count), f"{total / 1000:.3f}", f"{median:.1f}"]
             for where, name, count, total, median in t["steps"]]))
    return tables


def _cost(r: dict) -> str:
    """What tracing adds to one computation: the difference of the median CPU times of all
    processes (wall-clock rates on a shared machine are noisier)."""
    untraced, traced = r["cpu_us"]["untraced"]["median"], r["cpu_us"]["traced"]["median"]
    if not untraced:
        return "n/a"
    return f"{traced - untraced:+.1f} us CPU ({100 * (traced / untraced - 1):+.0f}%)"


def summary(data: dict) -> list[str]:
    n = str(max(data["stages"]))
    x = report.ratio(data["rates"][n]["parallel"], data["rates"][n]["sequential"])
    verdict = report.verdict(data, x >= 3, f"**missed** by {3 - x:.2f}x")
    lines = [*report.unjudged(data), f"{n} stages: parallel is {x:.2f}x sequential (target >= 3x): {verdict}"]
    if "hops" in data:
        t = data["hops"]
        hop = report.ratio(t["hop_us"], t["raw_us"])
        verdict = report.verdict(data, hop <= 3, f"**missed** by {hop - 3:.2f}x")
        lines.append(f"one stage hop of the {t['stages']}-stage pipeline: {t['hop_us']['median']:,.0f} us, "
                     f"{hop:.2f}x a raw TCP round trip (target <= 3x): {verdict}")
    for what, r in data.get("overhead", {}).items():
        lines.append(f"timeline overhead, {what}: {_cost(r)} per computation, all processes")
    return lines


def notes(data: dict) -> str:
    return """
The timeline of one 16-stage step (`python examples/trace_pipeline.py OUT.json --png OUT.png`;
open the JSON at ui.perfetto.dev), before and after the lean dispatch path:
[before](docs/timeline-pipeline-before.png) ([JSON](docs/timeline-pipeline-before.json)),
[after](docs/timeline-pipeline-after.png) ([JSON](docs/timeline-pipeline-after.json)).
The controller has released every node of a step before the first one runs (its steps
above take tens of microseconds, once per step), so a stage is all worker: waiting for its
input, the data-plane thread receiving and storing it (`receive data`), one tiny `execute`
and the `send` to the next stage. Those three take about a third of a hop; the rest is the
hand-offs between threads and processes (data-plane thread to executor, executor to send
pool, sender to the next host's socket), each a wake-up of a Python thread on 2 cores
shared by 16 workers, the controller and the client. The raw TCP round trip is two
processes doing nothing else. What would close the gap: a core per worker (each wake-up
then finds its core free), and the executor reading the transfer it waits for itself
instead of being woken by the data-plane thread. A sequential stage adds a done report to
the controller and a release back, two more cross-process hops of the same kind, which is
why parallel/sequential stays between 1.5x and 2.3x rather than growing with the stage
count.
"""


def plot(data: dict, path: str) -> None:
    report.plot_lines(path, "Pipeline of one-host stages (Figure 7)", "stages", "computations/s",
                      [(mode, data["stages"], [data["rates"][str(n)][mode]["median"] for n in data["stages"]])
                       for mode in ("parallel", "sequential")], logx=True)
