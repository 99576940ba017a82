"""``python -m pathways bench dispatch``: computations per second for a tiny computation.

Four ways to run N scalar additions on one CPU device, measured alternately in rounds so
that machine noise hits them alike; medians are reported with ratios to plain JAX:

- plain JAX, one process, async dispatch of N jitted calls (the baseline);
- pathways op by op: N calls of a compiled function, each its own submission;
- pathways program: a ``@pw.program`` chaining 128 calls, submitted N/128 times;
- fused: one computation running 128 additions in a fori_loop (plain JAX and pathways).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw

CHAIN = 128


def _timed(run: Callable[[], object], ops: int) -> float:
    start = time.perf_counter()
    run()
    return ops / (time.perf_counter() - start)


def main(address: Optional[str] = None, rounds: int = 5, programs: int = 40) -> dict[str, float]:
    pw.connect(address)
    try:
        return _measure(rounds, programs)
    finally:
        pw.disconnect()


def _measure(rounds: int, programs: int) -> dict[str, float]:
    n = CHAIN * programs
    one = pw.make_virtual_device_set().add_slice(cpu_devices=1)
    inc = pw.jit(lambda x: x + 1.0, mesh=one.mesh("d"))
    fused = pw.jit(lambda x: jax.lax.fori_loop(0, CHAIN, lambda i, v: v + 1.0, x), mesh=one.mesh("d"))

    @pw.program
    def chain(x):
        for _ in range(CHAIN):
            x = inc(x)
        return x

    jax_inc = jax.jit(lambda x: x + 1.0)
    jax_fused = jax.jit(lambda x: jax.lax.fori_loop(0, CHAIN, lambda i, v: v + 1.0, x))

    def plain() -> None:
        x = jnp.float32(0)
        for _ in range(n):
            x = jax_inc(x)
        x.block_until_ready()

    def plain_fused() -> None:
        x = jnp.float32(0)
        for _ in range(programs):
            x = jax_fused(x)
        x.block_until_ready()

    def op_by_op() -> None:
        x = pw.device_put(np.float32(0), one.devices)
        for _ in range(n // 8):  # op by op is slow; a smaller batch keeps the round short
            x = inc(x)
        assert float(np.asarray(x)) == n // 8

    def program() -> None:
        x = pw.device_put(np.float32(0), one.devices)
        for _ in range(programs):
            x = chain(x)
        assert float(np.asarray(x)) == n

    def pw_fused() -> None:
        x = pw.device_put(np.float32(0), one.devices)
        for _ in range(programs):
            x = fused(x)
        assert float(np.asarray(x)) == n

    cases = {"plain JAX, op by op": (plain, n), "pathways, op by op": (op_by_op, n // 8),
             f"pathways, {CHAIN}-node program": (program, n),
             f"plain JAX, {CHAIN} fused in one jit": (plain_fused, n),
             f"pathways, {CHAIN} fused in one jit": (pw_fused, n)}
    for run, _ in cases.values():  # warm up: compile everywhere, trace the program
        run()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (run, ops) in cases.items():
            samples[name].append(_timed(run, ops))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["plain JAX, op by op"]
    print(f"tiny computation (scalar add, 1 CPU device), {rounds} alternating rounds, medians:")
    print(f"{'mode':40} {'computations/s':>15} {'us/computation':>15} {'vs plain JAX':>13}")
    for name, rate in medians.items():
        print(f"{name:40} {rate:15,.0f} {1e6 / rate:15.1f} {base / rate:12.2f}x")
    return medians
