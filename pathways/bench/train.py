"""``python -m pathways bench train``: training throughput of GPipe pipeline parallelism next
to SPMD data parallelism, same model, same devices.

A local cluster of one island of ``hosts`` one-device hosts trains the MLP of
``pathways.bench.gpipe`` (one residual block per host) from the same initial parameters on
the same global batches, two ways:

- pipeline: one stage per host, each on its own 1-device slice; a step is one ``@pw.program``
  of forward, backward and update over ``microbatches`` microbatches;
- data parallel: one ``pw.jit`` on one slice of all the devices (so all the hosts, one
  jax.distributed group), the batch sharded over the mesh axis, parameters replicated; a
  step is that one computation (loss, gradients with the all-reduce XLA inserts, SGD).

Rounds alternate the two so that machine noise hits both alike; each round times ``steps``
steps (submitted back to back, timed until the last step's loss is ready). Medians of steps
and samples per second are reported, with their ratio, and the two runs' losses are
compared step by step: both optimize the mean loss over the global batch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

import pathways as pw
from pathways.bench import gpipe

# Large enough that a step's computations take a measurable share of its time next to the
# runtime's per-computation cost, small enough for a full run in a few minutes on 2 cores.
CONFIG = gpipe.Config(stages=4, microbatches=4, batch=256, width=128, hidden=256, lr=0.3)
_FETCH_TIMEOUT = 120.0


def data_parallel_step(params: list[gpipe.StageParams], x: jax.Array, t: jax.Array,
                       lr: float) -> tuple[list[gpipe.StageParams], jax.Array]:
    loss, grads = jax.value_and_grad(gpipe.model_loss)(params, x, t)
    return [gpipe.sgd(p, g, lr) for p, g in zip(params, grads)], loss


def main(rounds: int = 5, hosts: int = 4, steps: int = 20, cfg: gpipe.Config = CONFIG) -> dict[str, float]:
    """Start the cluster, measure, print the table; returns the medians, their ratio and the
    largest difference between the two runs' losses. ``cfg.stages`` is set to ``hosts``."""
    cfg = dataclasses.replace(cfg, stages=hosts)
    with pw.local_cluster(islands=[pw.Island(hosts=hosts, devices_per_host=1)]):
        return _measure(cfg, rounds, steps)


def _measure(cfg: gpipe.Config, rounds: int, steps: int) -> dict[str, float]:
    vds = pw.make_virtual_device_set()
    stages = [vds.add_slice(cpu_devices=1) for _ in range(cfg.stages)]
    everything = vds.add_slice(cpu_devices=cfg.stages)
    if len({s.workers for s in stages}) != cfg.stages or len(everything.workers) != cfg.stages:
        raise RuntimeError(f"stages landed on hosts {[s.workers for s in stages]} and the data-parallel "
                           f"slice on {everything.workers}; each needs one device of every host")
    pipeline = gpipe.Pipeline(cfg, stages)
    mesh = everything.mesh(("x",))
    dp_fn = pw.jit(gpipe.named(data_parallel_step, "data_parallel_step", lr=cfg.lr), mesh=mesh,
                   in_shardings=(None, pw.P("x"), pw.P("x")))
    batches = gpipe.make_batches(cfg, 1 + rounds * steps)
    pipe_params: list[Any] = gpipe.init_params(cfg)
    dp_params: list[Any] = gpipe.init_params(cfg)
    pipe_losses: list[pw.Array] = []
    dp_losses: list[pw.Array] = []

    def pipe_steps(chunk: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        nonlocal pipe_params
        pipe_params, losses = pipeline.train(pipe_params, chunk)
        pipe_losses.extend(losses)
        losses[-1].block_until_ready(_FETCH_TIMEOUT)

    def dp_steps(chunk: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        nonlocal dp_params
        for x, t in chunk:
            dp_params, loss = dp_fn(dp_params, x, t)
            dp_losses.append(loss)
        dp_losses[-1].block_until_ready(_FETCH_TIMEOUT)

    runs: dict[str, Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], None]] = {
        f"GPipe, {cfg.stages} stages x 1 host, {cfg.microbatches} microbatches": pipe_steps,
        f"data parallel, 1 slice of {cfg.stages} hosts": dp_steps}
    for run in runs.values():  # compiles everywhere and traces the program
        run(batches[:1])
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        chunk = batches[1 + r * steps:1 + (r + 1) * steps]
        for name, run in runs.items():
            start = time.perf_counter()
            run(chunk)
            rates[name].append(steps / (time.perf_counter() - start))

    diff = float(np.max(np.abs(np.subtract([float(a.to_numpy(_FETCH_TIMEOUT)) for a in pipe_losses],
                                           [float(a.to_numpy(_FETCH_TIMEOUT)) for a in dp_losses]))))
    medians = {name: statistics.median(v) for name, v in rates.items()}
    pipe_rate, dp_rate = medians.values()
    print(f"training throughput: {cfg.stages}-block MLP (width {cfg.width}, hidden {cfg.hidden}), "
          f"global batch {cfg.batch}, {cfg.stages} one-device hosts of one island, {rounds} alternating "
          f"rounds of {steps} steps, medians:")
    print(f"{'mode':50} {'steps/s':>9} {'samples/s':>11}")
    for name, rate in medians.items():
        print(f"{name:50} {rate:9.2f} {rate * cfg.batch:11,.0f}")
    print(f"pipeline / data parallel: {pipe_rate / dp_rate:.2f}x")
    print(f"losses agree over {len(pipe_losses)} steps: {'yes' if diff <= 1e-5 else 'NO'} "
          f"(max abs difference {diff:.3g}; first {float(pipe_losses[0].to_numpy()):.4f}, "
          f"last {float(pipe_losses[-1].to_numpy()):.4f})")
    return {"pipeline_steps_per_s": pipe_rate, "pipeline_samples_per_s": pipe_rate * cfg.batch,
            "data_parallel_steps_per_s": dp_rate, "data_parallel_samples_per_s": dp_rate * cfg.batch,
            "ratio": pipe_rate / dp_rate, "max_loss_difference": diff}
