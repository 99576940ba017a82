"""``python -m pathways bench train``: training throughput of a pipelined model next to SPMD
data parallelism, same model, same devices (the paper's Table 2, as ratios).

The MLP of ``pathways_bench.gpipe`` (one residual block per host) is trained from the same
initial parameters on the same global batches, three ways, on ``hosts`` one-device hosts:

- GPipe on pathways: one stage per host, each on its own 1-device slice; a step is one
  ``@pw.program`` of forward, backward and update over ``microbatches`` microbatches;
- data parallel on pathways: ``gpipe.data_parallel_step`` as one ``pw.jit`` on one slice of
  every host (one jax.distributed group of the workers), batch sharded, parameters
  replicated;
- data parallel, multi-controller JAX: the same ``gpipe.data_parallel_step`` under
  ``jax.jit`` in every process of a ``pw.spmd`` group of ``hosts`` processes.

Rounds alternate the three; each round times ``steps`` steps, submitted back to back and
timed until the last step's loss is ready (multi-controller JAX is timed inside its
processes). The runs' losses are compared step by step: all optimize the mean loss over the
global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import numpy as np

import pathways as pw
from pathways_bench import gpipe, report

TITLE = "Training: a pipelined model against SPMD data parallelism"
PAPER = "Table 2"
PAPER_RESULT = ("pathways trains Transformer models at the throughput of multi-controller JAX, and a model "
                "pipelined over 16 stages reaches throughput comparable to SPMD")
ROUNDS = 5
# Large enough that a step's computations take a measurable share of its time next to the
# runtime's per-computation cost, small enough for a full run in a few minutes on 2 cores.
CONFIG = gpipe.Config(stages=4, microbatches=4, batch=256, width=128, hidden=256, lr=0.3)
TINY = gpipe.Config(stages=2, microbatches=2, batch=16, width=8, hidden=16, lr=0.3)
_FETCH_TIMEOUT = 120.0
MODES = ("GPipe, pathways", "data parallel, pathways", "data parallel, JAX")

ABOUT = f"""
The residual MLP of `pathways_bench/gpipe.py` ({CONFIG.stages} blocks of width {CONFIG.width}, hidden
{CONFIG.hidden}, global batch {CONFIG.batch}) trained from the same initial parameters on the same
batches, on {CONFIG.stages} one-device hosts: GPipe on pathways (one stage per host,
{CONFIG.microbatches} microbatches, one `@pw.program` per step); data parallel on pathways (one
`pw.jit` over a slice of all hosts); data parallel in multi-controller JAX (`pw.spmd`, the
same step function under `jax.jit`). The paper's Table 2 shows pathways matching
multi-controller JAX and pipelining being competitive with SPMD.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    cfg = TINY if tiny else CONFIG
    steps = 2 if tiny else 20
    progress.expect(1 + rounds * len(MODES))
    progress.step(f"starting {cfg.stages} hosts and {cfg.stages} JAX processes")
    with pw.local_cluster(islands=[pw.Island(hosts=cfg.stages, devices_per_host=1)]), \
            pw.spmd.Pool(cfg.stages, echo=False) as pool:
        return _measure(cfg, rounds, steps, pool, progress)


def _measure(cfg: gpipe.Config, rounds: int, steps: int, pool: pw.spmd.Pool, progress: report.Progress) -> dict:
    vds = pw.make_virtual_device_set()
    stages = [vds.add_slice(cpu_devices=1) for _ in range(cfg.stages)]
    everything = vds.add_slice(cpu_devices=cfg.stages)
    if len({s.workers for s in stages}) != cfg.stages or len(everything.workers) != cfg.stages:
        raise RuntimeError(f"stages landed on hosts {[s.workers for s in stages]} and the data-parallel "
                           f"slice on {everything.workers}; each needs one device of every host")
    pipeline = gpipe.Pipeline(cfg, stages)
    dp_fn = pw.jit(gpipe.named(gpipe.data_parallel_step, "data_parallel_step", lr=cfg.lr),
                   mesh=everything.mesh(("x",)), in_shardings=(None, pw.P("x"), pw.P("x")))
    batches = gpipe.make_batches(cfg, 1 + rounds * steps)
    params: dict[str, Any] = {m: gpipe.init_params(cfg) for m in MODES}
    losses: dict[str, list] = {m: [] for m in MODES}

    def pipe_steps(chunk: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        start = time.perf_counter()
        params[MODES[0]], ls = pipeline.train(params[MODES[0]], chunk)
        ls[-1].block_until_ready(_FETCH_TIMEOUT)
        elapsed = time.perf_counter() - start
        losses[MODES[0]].extend(ls)
        return len(chunk) / elapsed

    def dp_steps(chunk: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        start = time.perf_counter()
        ls = []
        for x, t in chunk:
            params[MODES[1]], loss = dp_fn(params[MODES[1]], x, t)
            ls.append(loss)
        ls[-1].block_until_ready(_FETCH_TIMEOUT)
        elapsed = time.perf_counter() - start
        losses[MODES[1]].extend(ls)
        return len(chunk) / elapsed

    def jax_steps(chunk: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        rate, params[MODES[2]], ls = pool.run(_jax_train, (cfg, params[MODES[2]], list(chunk)))
        losses[MODES[2]].extend(ls)
        return rate

    runs: dict[str, Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], float]] = dict(
        zip(MODES, (pipe_steps, dp_steps, jax_steps)))
    for run in runs.values():  # compiles everywhere and traces the program
        run(batches[:1])
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        chunk = batches[1 + r * steps:1 + (r + 1) * steps]
        for name, run in runs.items():
            progress.step(f"{name} (round {r + 1}/{rounds})")
            rates[name].append(run(chunk))
    values = {m: [float(x) if isinstance(x, float) else float(x.to_numpy(_FETCH_TIMEOUT)) for x in ls]
              for m, ls in losses.items()}
    base = np.asarray(values[MODES[2]])
    return {"config": dataclasses.asdict(cfg), "steps": steps,
            "rates": {m: report.stats(v) for m, v in rates.items()},
            "losses": {"first": values[MODES[2]][0], "last": values[MODES[2]][-1], "steps": len(base),
                       "max_difference_vs_jax": {m: float(np.max(np.abs(np.asarray(values[m]) - base)))
                                                 for m in MODES[:2]}}}


@functools.lru_cache(maxsize=None)
def _jax_step(cfg: gpipe.Config) -> tuple[Any, Any, Any]:
    """In a multi-controller process: the jitted step on the group's mesh, built once."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = pw.spmd.mesh("x")
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    step = jax.jit(functools.partial(gpipe.data_parallel_step, lr=cfg.lr),
                   in_shardings=(replicated, batch, batch), out_shardings=(replicated, replicated))
    return step, replicated, batch


def _jax_train(cfg: gpipe.Config, params: list, chunk: list) -> tuple[float, list, list[float]]:
    """In every multi-controller process: ``len(chunk)`` steps; steps per second, the new
    parameters and the losses."""
    step, replicated, batch = _jax_step(cfg)
    p = pw.spmd.device_put(params, replicated)
    start = time.perf_counter()
    ls = []
    for x, t in chunk:
        p, loss = step(p, pw.spmd.device_put(x, batch), pw.spmd.device_put(t, batch))
        ls.append(loss)
    ls[-1].block_until_ready()
    elapsed = time.perf_counter() - start
    return len(chunk) / elapsed, pw.spmd.to_host(p), [float(x) for x in pw.spmd.to_host(ls)]


def tables(data: dict) -> list[report.Table]:
    cfg, jax_rate = data["config"], data["rates"][MODES[2]]
    rows = [[m, report.rate(data["rates"][m], 2), f"{data['rates'][m]['median'] * cfg['batch']:,.0f}",
             report.times(report.ratio(data["rates"][m], jax_rate))] for m in MODES]
    return [report.Table(f"training steps per second, {cfg['stages']} one-device hosts, median (min-max)",
                         ["mode", "steps/s", "samples/s", "vs data parallel, JAX"], rows)]


def summary(data: dict) -> list[str]:
    d = data["losses"]
    return [f"GPipe on pathways is {report.ratio(data['rates'][MODES[0]], data['rates'][MODES[2]]):.2f}x data "
            f"parallel multi-controller JAX; data parallel on pathways is "
            f"{report.ratio(data['rates'][MODES[1]], data['rates'][MODES[2]]):.2f}x it",
            f"losses over {d['steps']} steps (first {d['first']:.4f}, last {d['last']:.4f}); largest difference "
            "from multi-controller JAX: " + ", ".join(f"{m} {v:.2g}" for m, v in d["max_difference_vs_jax"].items())]


def notes(data: dict) -> str:
    return """
Data parallelism pays gloo's CPU all-reduce of every gradient between processes on the
same 2 cores; the pipeline sends only activations and their gradients between neighbours,
so on this machine it trains faster. Pathways data parallelism runs the same executable as
multi-controller JAX on the same number of processes, plus one submission per step.
"""


def plot(data: dict, path: str) -> None:
    report.plot_bars(path, "Training throughput (Table 2)", "steps/s", ["median"],
                     {m: [data["rates"][m]["median"]] for m in MODES})
