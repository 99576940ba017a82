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

import statistics
import time
from typing import Callable, Sequence

import numpy as np

import pathways as pw

STAGES = (1, 2, 4, 8, 16)


def _chain(stages: Sequence[pw.Slice], dispatch: str) -> Callable:
    fns = [pw.jit(lambda x: x + 1.0, mesh=s.mesh("d")) for s in stages]

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


def main(rounds: int = 5, stages: Sequence[int] = STAGES, computations: int = 256) -> dict[int, dict[str, float]]:
    """Measure each chain length; each round runs about ``computations`` computations per mode."""
    hosts = max(stages)
    print(f"starting {hosts} one-host islands ...", flush=True)
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=1)] * hosts, start_timeout=300.0):
        vds = pw.make_virtual_device_set()
        slices = [vds.add_slice(cpu_devices=1, island=i) for i in range(hosts)]
        if len({s.workers for s in slices}) != hosts:
            raise AssertionError("the stages did not land on distinct hosts")
        results = {}
        for n in stages:
            programs = {mode: _chain(slices[:n], mode) for mode in ("parallel", "sequential")}
            runs = max(computations // n, 4)
            for mode, program in programs.items():  # warm up: compile, first transfers
                _timed(program, slices[0], 2, n)
            rates: dict[str, list[float]] = {mode: [] for mode in programs}
            for _ in range(rounds):
                for mode, program in programs.items():
                    rates[mode].append(_timed(program, slices[0], runs, n))
            results[n] = {mode: statistics.median(r) for mode, r in rates.items()}
            results[n]["spread"] = {mode: (min(r), max(r)) for mode, r in rates.items()}
            print(f"  {n:2d} stage(s): parallel {results[n]['parallel']:8.0f}/s, "
                  f"sequential {results[n]['sequential']:8.0f}/s", flush=True)
    _print(results, rounds)
    return results


def _print(results: dict[int, dict], rounds: int) -> None:
    print(f"\ncomputations per second, scalar x + 1 per stage, one host per stage "
          f"(median of {rounds} rounds; min-max)")
    print(f"{'stages':>6}  {'parallel':>22}  {'sequential':>22}  {'parallel/sequential':>19}")
    for n, r in results.items():
        cells = [f"{r[m]:8.0f} ({r['spread'][m][0]:.0f}-{r['spread'][m][1]:.0f})" for m in ("parallel", "sequential")]
        print(f"{n:>6}  {cells[0]:>22}  {cells[1]:>22}  {r['parallel'] / r['sequential']:>18.2f}x")
