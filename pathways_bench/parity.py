"""``python -m pathways bench parity``: the smallest computation at which pathways matches
multi-controller JAX (the paper's Figure 6).

The dispatch benchmark's computation (a scalar all-reduce and an add) is padded with real
work: ``k`` steps of ``tanh(m @ w)`` on a 64x64 float32 matrix, ``k`` calibrated on this
machine so that the work alone takes about 0.05 to 50 ms on one device. For each duration
and host count, pathways op by op (every call its own submission: the mode where the
runtime's cost per computation shows) and multi-controller JAX op by op run alternately;
the parity point is the smallest duration at which pathways reaches 95% of JAX's
throughput and stays there: no longer duration falls below 90% (the noise of one sample).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from pathways_bench import dispatch, report

TITLE = "Parity: the smallest computation at which pathways reaches 95% of multi-controller JAX"
PAPER = "Figure 6"
PAPER_RESULT = "parity from 2.3 ms of computation with 16 hosts of 128 TPUs"
ROUNDS = 3
HOSTS = (1, 2, 4)
DURATIONS_MS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
PARITY = 0.95
NOISE_FLOOR = 0.9
SIZE = 64
_SAMPLE_SECONDS = 0.3  # per sample, so that short computations are not timer noise
_MAX_CALLS = 256

ABOUT = f"""
The dispatch benchmark's computation (scalar all-reduce and add) padded with real work:
`k` steps of `tanh(m @ w)` on a {SIZE}x{SIZE} float32 matrix, `k` calibrated on this machine so
that the work alone takes 0.05 to 50 ms on one device. Pathways op by op (each call its own
submission) against multi-controller JAX op by op, alternately. The parity point is the
smallest duration at which pathways reaches {PARITY:.0%} of JAX's throughput and stays there:
no longer duration falls below {NOISE_FLOOR:.0%} (about the noise of one sample here). Target:
<= 2.3 ms.
"""


def _work(x: Any, k: int) -> Any:
    """``k`` steps of real work seeded by the scalar ``x`` (so it cannot be hoisted), folded
    back into a scalar (so it cannot be dropped), then the all-reduce and the add."""
    import jax
    import jax.numpy as jnp

    m0 = jnp.full((SIZE, SIZE), 1.0, jnp.float32) * (x * 1e-6)
    w = jnp.eye(SIZE, dtype=jnp.float32) * 0.5 + 0.01
    m = jax.lax.fori_loop(0, k, lambda _, m: jnp.tanh(m @ w), m0)
    return jax.lax.pmean(x + jnp.mean(m) * 1e-9, "i") + 1.0


def calibrate(durations_ms: tuple[float, ...]) -> dict[float, int]:
    """Steps of work per target duration, from timing the work on one device here."""
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda x, k: jax.lax.fori_loop(
        0, k, lambda _, m: jnp.tanh(m @ (jnp.eye(SIZE, dtype=jnp.float32) * 0.5)), jnp.full((SIZE, SIZE), x)))
    fn(jnp.float32(1), 10).block_until_ready()
    steps = 2000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        fn(jnp.float32(1), steps).block_until_ready()
        best = min(best, time.perf_counter() - start)
    per_step_ms = best * 1e3 / steps
    return {d: max(1, round(d / per_step_ms)) for d in durations_ms}


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    hosts = HOSTS[:2] if tiny else HOSTS
    durations = DURATIONS_MS[:2] if tiny else DURATIONS_MS
    steps = calibrate(durations)
    progress.expect(len(hosts) * (1 + len(durations) * rounds * 2))
    results = {}
    for h in hosts:
        results[str(h)] = _measure_hosts(h, durations, steps, rounds, tiny, progress)
    return {"hosts": list(hosts), "durations_ms": list(durations), "steps": {str(d): k for d, k in steps.items()},
            "rates": results}


def parity_point(durations: list[float] | tuple[float, ...], rates: dict, sustained: bool = True) -> float | None:
    """The parity point: the smallest duration whose ratio is at least PARITY and, when
    ``sustained``, after which no longer duration falls below NOISE_FLOOR (one sample's
    noise here is about 5%, so a single 0.94 does not undo parity; a real dip does). None if
    there is none."""
    ratios = [report.ratio(rates[str(d)]["PW-O"], rates[str(d)]["JAX-O"]) for d in durations]
    for i, d in enumerate(durations):
        if ratios[i] >= PARITY and (not sustained or min(ratios[i:]) >= NOISE_FLOOR):
            return d
    return None


def _measure_hosts(hosts: int, durations: tuple[float, ...], steps: dict[float, int], rounds: int, tiny: bool,
                   progress: report.Progress) -> dict:
    import pathways as pw

    progress.step(f"starting {hosts} host(s) and {hosts} JAX process(es)")
    out = {}
    with pw.local_cluster(islands=[pw.Island(hosts=hosts, devices_per_host=1)]), \
            pw.spmd.Pool(hosts, echo=False) as pool:
        devices = pw.make_virtual_device_set().add_slice(cpu_devices=hosts).devices
        for d in durations:
            calls = 4 if tiny else max(4, min(_MAX_CALLS, round(_SAMPLE_SECONDS * 1e3 / max(d, 0.2))))
            k = steps[d]
            cases = {"PW-O": _pathways_case(devices, k, calls),
                     "JAX-O": lambda k=k, calls=calls: pool.run(_jax_loop, (k, calls))}
            for run in cases.values():  # compile
                run()
            samples = report.alternate(rounds, cases, progress)
            out[str(d)] = {m: report.stats(s) for m, s in samples.items()}
            out[str(d)]["calls"] = calls
    return out


def _pathways_case(devices: Any, k: int, calls: int) -> Callable[[], float]:
    import numpy as np

    import pathways as pw

    fn = pw.pmap(functools.partial(_work, k=k), devices=devices)

    def run() -> float:
        elapsed, value = dispatch.pathways_chain(fn, devices, calls)
        if not np.all(np.isfinite(value)):
            raise AssertionError(f"pathways computed {value}")
        return calls / elapsed

    return run


def _jax_loop(k: int, calls: int) -> float:
    """In every process of the group: ``calls`` chained calls; computations per second."""
    elapsed, _ = dispatch.spmd_chain(calls, _work, k=k)
    return calls / elapsed


def tables(data: dict) -> list[report.Table]:
    out = []
    for h in data["hosts"]:
        rows = []
        for d in data["durations_ms"]:
            r = data["rates"][str(h)][str(d)]
            rows.append([f"{d:g}", report.rate(r["JAX-O"]), report.rate(r["PW-O"]),
                         report.times(report.ratio(r["PW-O"], r["JAX-O"]))])
        out.append(report.Table(f"{h} host(s): computations per second, op by op", ["work (ms)", "JAX-O", "PW-O",
                                                                                     "PW-O/JAX-O"], rows))
    return out


def summary(data: dict) -> list[str]:
    lines = report.unjudged(data)
    for h in data["hosts"]:
        rates, durations = data["rates"][str(h)], data["durations_ms"]
        p, first = parity_point(durations, rates), parity_point(durations, rates, sustained=False)
        reached = f"{PARITY:.0%} first reached at {first:g} ms" if first is not None else "never reached"
        if p is None:
            verdict = report.verdict(data, False, "**target missed**")
            lines.append(f"{h} host(s): no parity point up to {durations[-1]:g} ms ({reached}): {verdict}")
        else:
            verdict = report.verdict(data, p <= 2.3, f"**missed** by {p - 2.3:g} ms")
            lines.append(f"{h} host(s): parity point {p:g} ms of work ({reached}; target <= 2.3 ms): {verdict}")
    return lines


def notes(data: dict) -> str:
    shortest = data["durations_ms"][0]
    extra = []
    for h in data["hosts"]:
        r = data["rates"][str(h)][str(shortest)]
        extra.append(f"{h} host(s) {1e6 / r['PW-O']['median'] - 1e6 / r['JAX-O']['median']:,.0f} us")
    return f"""
Op by op, pathways pays a fixed cost per call on top of the computation: the client's
submission, the controller, the worker's dispatch and done report, all Python, all on the
same cores as the computation (the dispatch benchmark's CPU table). At the shortest
computation it costs, per call, {", ".join(extra)} more than multi-controller JAX;
once the computation is several times longer, the two converge, though not fully: from a
few milliseconds on, the ratio scatters between about 0.8 and 1.1 from one duration to the
next, a few percent below 1 on average. Each sample there is only a few calls long (about
0.3 s), and a pathways computation shares the 2 cores with more processes (client,
controller, the workers' service threads) than a JAX one. The scatter and that small
deficit push the parity point past 2.3 ms here; more rounds at the long durations would
narrow the first, a core per process would remove the second.
"""


def plot(data: dict, path: str) -> None:
    series = []
    for h in data["hosts"]:
        ratios = [report.ratio(data["rates"][str(h)][str(d)]["PW-O"], data["rates"][str(h)][str(d)]["JAX-O"])
                  for d in data["durations_ms"]]
        series.append((f"{h} host(s)", data["durations_ms"], ratios))
    report.plot_lines(path, "Parity with multi-controller JAX (Figure 6)", "work per computation (ms)",
                      "PW-O / JAX-O throughput", series, logx=True, hline=PARITY)
