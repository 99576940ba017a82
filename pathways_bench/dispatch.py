"""``python -m pathways bench dispatch``: dispatch throughput against multi-controller JAX
(the paper's Figure 5).

Computation: a scalar all-reduce and an add, ``x = pmean(x) + 1`` over one CPU device per
host, its output fed to the next call, on 1, 2 and 4 hosts. Six ways to run N of them:

- JAX-O: multi-controller JAX, N jitted calls per process, dispatched asynchronously;
- JAX-F: multi-controller JAX, 128 computations fused in one jitted ``fori_loop``;
- PW-O: pathways op by op, every call its own submission from the client;
- PW-C: pathways, a ``@pw.program`` chaining 128 calls, one submission per 128 (the paper's
  measure: one node per call);
- PW-C fused: the same program traced with ``fuse=True``, its 128 calls one executable;
- PW-F: pathways, the fused 128-computation function.

For each host count a pathways cluster (one island of H one-device hosts) and a
multi-controller group (``pw.spmd.Pool`` of H processes) are started side by side; every
round runs the six modes in turn. JAX is timed inside its processes (process 0's wall
time from the first dispatch to the last result); pathways on its client, from the first
submission to the fetched result, which is also checked.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from typing import Any, Callable

from pathways_bench import report

TITLE = "Dispatch: computations per second, pathways against multi-controller JAX"
PAPER = "Figure 5"
PAPER_RESULT = ("chained (PW-C) and fused (PW-F) programs match multi-controller JAX, and chained beats JAX "
                "op by op; pathways op by op (PW-O) is far slower than JAX-O")
ROUNDS = 5
HOSTS = (1, 2, 4)
CHAIN = 128
MODES = ("JAX-O", "JAX-F", "PW-O", "PW-C", "PW-C fused", "PW-F")
# Computations per sample: about half a second on 2 cores for the slowest host count.
_COUNTS = {"JAX-O": 512, "JAX-F": 8 * CHAIN, "PW-O": 256, "PW-C": 4 * CHAIN, "PW-C fused": 8 * CHAIN,
           "PW-F": 8 * CHAIN}
_TINY_COUNTS = {"JAX-O": 16, "JAX-F": CHAIN, "PW-O": 8, "PW-C": CHAIN, "PW-C fused": CHAIN, "PW-F": CHAIN}
TARGETS = (("PW-F", "JAX-F", 0.95), ("PW-C", "JAX-O", 1.0), ("PW-O", "JAX-O", 0.5))

ABOUT = f"""
The computation is a scalar all-reduce and an add (`x = pmean(x) + 1` across one CPU device
per host), each output fed to the next call, on 1, 2 and 4 hosts. JAX-O dispatches the
jitted computation call by call from every process of a multi-controller group; JAX-F runs
{CHAIN} of them fused in one `fori_loop`. PW-O submits each call from the pathways client;
PW-C traces {CHAIN} calls into one `@pw.program` (a node per call, the paper's measure);
PW-C fused is that program with `fuse=True`, which compiles the {CHAIN} calls into one
executable (reported beside PW-C, with no target of its own); PW-F runs the fused function
on pathways. Targets on 2 and 4 hosts: PW-F >= 0.95x JAX-F, PW-C >= 1.0x JAX-O, PW-O >= 0.5x
JAX-O.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    hosts = HOSTS[:2] if tiny else HOSTS
    counts = _TINY_COUNTS if tiny else _COUNTS
    progress.expect(len(hosts) * (rounds * len(MODES) + 1))
    rows = {}
    for h in hosts:
        rows[str(h)] = _measure_hosts(h, rounds, counts, progress)
    return {"hosts": list(hosts), "chain": CHAIN, "counts": counts, "rates": rows}


def _measure_hosts(hosts: int, rounds: int, counts: dict[str, int], progress: report.Progress) -> dict:
    import pathways as pw

    progress.step(f"starting {hosts} host(s) and {hosts} JAX process(es)")
    with pw.local_cluster(islands=[pw.Island(hosts=hosts, devices_per_host=1)]) as cluster, \
            pw.spmd.Pool(hosts, echo=False) as pool:
        cases = _pathways_cases(hosts, counts)
        cases.update(_jax_cases(pool, counts))
        for run in cases.values():  # compile everywhere, trace the program
            run()
        # CPU time of every process taking part, per computation: on a machine with fewer
        # cores than processes, it bounds throughput.
        pids = {m: [os.getpid(), cluster.pids[0], *cluster.worker_pids()] if m.startswith("PW") else pool.pids
                for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}

        def accounted(mode: str) -> Callable[[], float]:
            def run() -> float:
                before = report.cpu_seconds(pids[mode])
                rate = cases[mode]()
                cpu[mode].append((report.cpu_seconds(pids[mode]) - before) / counts[mode])
                return rate
            return run

        samples = report.alternate(rounds, {m: accounted(m) for m in MODES}, progress)
    return {mode: {**report.stats(s), "cpu_us": 1e6 * statistics.median(cpu[mode])} for mode, s in samples.items()}


def _step(x: Any) -> Any:
    """The computation: a scalar all-reduce and an add."""
    import jax

    return jax.lax.pmean(x, "i") + 1.0


def _pathways_cases(hosts: int, counts: dict[str, int]) -> dict[str, Callable[[], float]]:
    import numpy as np

    import pathways as pw

    devices = pw.make_virtual_device_set().add_slice(cpu_devices=hosts).devices
    step = pw.pmap(_step, devices=devices)
    fused = pw.pmap(functools.partial(_chained, per_call=CHAIN), devices=devices)

    def steps(x):
        for _ in range(CHAIN):
            x = step(x)
        return x

    chain, chain_fused = pw.program(steps), pw.program(steps, fuse=True)

    def timed(fn: Callable[[Any], Any], calls: int, per_call: int) -> Callable[[], float]:
        def run() -> float:
            elapsed, value = pathways_chain(fn, devices, calls)
            if not np.all(value == calls * per_call):
                raise AssertionError(f"pathways computed {value}, expected {calls * per_call} everywhere")
            return calls * per_call / elapsed
        return run

    return {"PW-O": timed(step, counts["PW-O"], 1), "PW-C": timed(chain, counts["PW-C"] // CHAIN, CHAIN),
            "PW-C fused": timed(chain_fused, counts["PW-C fused"] // CHAIN, CHAIN),
            "PW-F": timed(fused, counts["PW-F"] // CHAIN, CHAIN)}


def pathways_chain(fn: Callable[[Any], Any], devices: Any, calls: int) -> tuple[float, Any]:
    """``calls`` chained calls of ``fn`` from zeros, one scalar per device: the seconds from
    the first submission to the fetched result, and the result."""
    import numpy as np

    import pathways as pw

    x = pw.device_put(np.zeros(len(devices), np.float32), devices)
    start = time.perf_counter()
    for _ in range(calls):
        x = fn(x)
    value = np.asarray(x)
    return time.perf_counter() - start, value


def _chained(x: Any, per_call: int) -> Any:
    import jax

    if per_call == 1:
        return _step(x)
    return jax.lax.fori_loop(0, per_call, lambda _, v: _step(v), x)


@functools.lru_cache(maxsize=None)
def spmd_fn(body: Callable[..., Any], **params: Any) -> tuple[Any, Any]:
    """In a multi-controller process: ``body(x, **params)`` on every device of the group (one
    scalar each, collectives over axis "i"), jitted, and its input's sharding; built once
    per process and parameters, compiled on the first call."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pathways as pw

    mesh = pw.spmd.mesh("i")
    # As pw.pmap (and jax.pmap): a collective's result may be a loop carry.
    fn = jax.jit(jax.shard_map(functools.partial(body, **params), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                               check_vma=False))
    return fn, NamedSharding(mesh, P("i"))


def spmd_chain(calls: int, body: Callable[..., Any], **params: Any) -> tuple[float, Any]:
    """In every multi-controller process: ``calls`` chained calls of :func:`spmd_fn`, from
    zeros; the seconds they took (dispatch to the last result) and this process's result."""
    import jax
    import numpy as np

    import pathways as pw

    fn, sharding = spmd_fn(body, **params)
    x = pw.spmd.device_put(np.zeros(jax.device_count(), np.float32), sharding)
    start = time.perf_counter()
    for _ in range(calls):
        x = fn(x)
    x.block_until_ready()
    return time.perf_counter() - start, np.asarray(x.addressable_shards[0].data)


def _jax_loop(calls: int, per_call: int) -> float:
    """In every process of the group: ``calls`` chained calls; computations per second."""
    import numpy as np

    elapsed, local = spmd_chain(calls, _chained, per_call=per_call)
    if not np.all(local == calls * per_call):
        raise AssertionError(f"JAX computed {local}, expected {calls * per_call}")
    return calls * per_call / elapsed


def _jax_cases(pool: Any, counts: dict[str, int]) -> dict[str, Callable[[], float]]:
    return {"JAX-O": lambda: pool.run(_jax_loop, (counts["JAX-O"], 1)),
            "JAX-F": lambda: pool.run(_jax_loop, (counts["JAX-F"] // CHAIN, CHAIN))}


def _modes(data: dict) -> list[str]:
    """The modes ``data`` holds: results saved before "PW-C fused" existed lack it."""
    return [m for m in MODES if all(m in data["rates"][str(h)] for h in data["hosts"])]


def tables(data: dict) -> list[report.Table]:
    modes = _modes(data)
    rows = []
    for h in data["hosts"]:
        r = data["rates"][str(h)]
        rows.append([str(h), *(report.rate(r[m]) for m in modes),
                     *(report.times(report.ratio(r[a], r[b])) for a, b, _ in TARGETS)])
    cpu = [[str(h), *(f"{data['rates'][str(h)][m]['cpu_us']:,.0f}" for m in modes)] for h in data["hosts"]]
    return [report.Table("computations per second, median (min-max) of the rounds",
                         ["hosts", *modes, "PW-F/JAX-F", "PW-C/JAX-O", "PW-O/JAX-O"], rows),
            report.Table("CPU time per computation (us), all processes of the mode together (client, controller "
                         "and workers; or the JAX processes), median of the rounds", ["hosts", *modes], cpu)]


def summary(data: dict) -> list[str]:
    lines = report.unjudged(data)
    if 1 in data["hosts"]:
        r = data["rates"]["1"]
        x = report.ratio(r["JAX-O"], r["PW-C"])
        verdict = report.verdict(data, x <= 2, f"**missed** by {x - 2:.2f}x")
        lines.append(f"1 host: a computation of the 128-node chain (PW-C) takes {x:.2f}x a plain `jax.jit` call "
                     f"(JAX-O) (target <= 2x): {verdict}")
    for a, b, target in TARGETS:
        for h in data["hosts"]:
            if h < 2:
                continue
            r = data["rates"][str(h)]
            x = report.ratio(r[a], r[b])
            verdict = report.verdict(data, x >= target, f"**missed** by {target - x:.2f}x")
            lines.append(f"{h} hosts: {a}/{b} = {x:.2f}x (target >= {target:g}x): {verdict}")
    if "PW-C fused" not in _modes(data):
        return lines
    for h in data["hosts"]:
        r = data["rates"][str(h)]
        lines.append(f"{h} host(s): PW-C fused/JAX-O = {report.times(report.ratio(r['PW-C fused'], r['JAX-O']))}, "
                     f"PW-C fused/PW-C = {report.times(report.ratio(r['PW-C fused'], r['PW-C']))} "
                     "(fuse=True; no target)")
    return lines


def notes(data: dict) -> str:
    cores = os.cpu_count() or 1
    lines = ["Why, from the CPU-time table (a profile of every process taking part): on this machine "
             f"every process shares {cores} cores, so a mode that needs C us of CPU per computation "
             f"cannot exceed {cores}/C computations per second, whatever its latency."]
    for h in data["hosts"]:
        if h < 2:
            continue
        r = data["rates"][str(h)]
        bound = {m: cores * 1e6 / r[m]["cpu_us"] if r[m]["cpu_us"] else math.inf for m in _modes(data)}
        lines.append(
            f"- {h} hosts: JAX-O takes {r['JAX-O']['cpu_us']:,.0f} us of CPU per computation over its "
            f"processes, PW-O {r['PW-O']['cpu_us']:,.0f} us (bound "
            f"{bound['PW-O']:,.0f}/s, measured {r['PW-O']['median']:,.0f}/s) and PW-C "
            f"{r['PW-C']['cpu_us']:,.0f} us (bound {bound['PW-C']:,.0f}/s, measured {r['PW-C']['median']:,.0f}/s).")
    lines.append(NOTES)
    return "\n".join(lines)


NOTES = """
Pathways pays, on the same cores, for what multi-controller JAX does not have: per call
the client's signature check and submission (~35 us), the controller's scheduling and
lowering of each run, and in each worker the run message, the executor's bookkeeping and
the done report; the all-reduce itself is the same gloo call. Op by op (PW-O), that is
several hundred microseconds of Python per computation per host, so PW-O runs at its CPU
bound. Calls that queue behind the scheduler's window are coalesced by the controller (one
dispatch and one payload per worker for up to 64 of them) and their done reports batched,
which leaves the workers' per-run work as the larger part. A chained program (PW-C) removes
the client's and the controller's cost per computation, leaving the worker's executor (one
Python call per computation, ~10 us, and the bookkeeping around it) next to the
all-reduce; with more hosts than cores the workers take turns on the cores, and every turn
delays the all-reduce of the others. Fused (PW-F, JAX-F) runs the same executable: the
difference is one submission per 128 computations.

What would close the gaps: a core per process (the client, controller and worker work
then overlaps the computation instead of taking turns with it: on hardware with one host
per machine, the CPU bound above disappears); and an executor loop outside Python for
chained programs.
"""


def plot(data: dict, path: str) -> None:
    groups = [f"{h} host(s)" for h in data["hosts"]]
    report.plot_bars(path, "Dispatch throughput (Figure 5)", "computations/s (log)", groups,
                     {m: [data["rates"][str(h)][m]["median"] for h in data["hosts"]] for m in _modes(data)}, logy=True)
