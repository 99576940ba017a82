"""``python -m pathways bench share``: proportional-share scheduling of clients on one island
(the paper's Figure 9).

One local cluster (one island, one host, one CPU device, policy ``fair``) is shared in turn
by sets of client processes, one per weight (1:1:1:1, then 1:2:4:8). Each client connects
with its weight, takes its own 1-device slice of the same device, and submits a small jitted
computation (a few ms of device time) continuously, keeping OUTSTANDING runs submitted and
not yet waited for, so that every client always has runs queued and the island stays
saturated. Once every client has compiled and filled its pipeline, the controller's
``status()`` is read, the measurement window passes, and ``status()`` is read again: the
per-session differences of reported device seconds and completed runs give each client's
share, compared with its target share weight / sum of weights. A 1-client run of the same
computation over the same window gives the throughput of one client alone, to compare with
the aggregate throughput of the clients sharing the device. Last, the same comparison with
small computations (one 8x8 step), where a single client cannot keep the device busy.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from typing import Optional, Sequence

import numpy as np

WEIGHT_SETS: tuple[tuple[float, ...], ...] = ((1, 1, 1, 1), (1, 2, 4, 8))
OUTSTANDING = 16  # runs per client submitted and not yet waited for: enough to stay queued
SIZE = 256
STEPS = 8  # tanh(x @ w) steps per run: about 2 ms on one CPU core
SMALL = (1, 8)  # (steps, size) of the small computation: microseconds of device time
READY = "ready"
_GRACE_SECONDS = 3.0
_START_TIMEOUT = 120.0
_SETTLE_SECONDS = 1.0  # after the last client is ready, so every queue is full when measuring
_POLL_SECONDS = 0.25


def main(address: Optional[str] = None, seconds: float = 10.0,
         weight_sets: Sequence[Sequence[float]] = WEIGHT_SETS) -> dict[str, dict]:
    """Run a 1-client baseline and then each weight set for ``seconds`` each; print the
    tables and return the measurements by label. Without ``address`` a local cluster of
    one 1-device island is started (and stopped); a given cluster should be one too, or
    the clients' slices may land on different devices and not compete."""
    from pathways.cluster import Island, LocalCluster

    cluster = None
    if address is None:
        cluster = LocalCluster([Island(1, 1)], policy="fair").start()
        address = cluster.address
    assert address is not None  # set by start()
    print(f"proportional share on one CPU device: {STEPS} x tanh(x @ w) on {SIZE}x{SIZE} float32 "
          f"per run, {OUTSTANDING} runs outstanding per client, {seconds:g} s window\n", flush=True)
    try:
        results = {"baseline": _measure(address, (1.0,), seconds)}
        base_rate = results["baseline"]["rate"]
        print(f"1 client alone: {base_rate:,.0f} completions/s, device busy "
              f"{results['baseline']['busy']:.0%}, {_ms(results['baseline'])} ms of device time per run\n", flush=True)
        for weights in weight_sets:
            label = ":".join(f"{w:g}" for w in weights)
            r = results[label] = _measure(address, tuple(float(w) for w in weights), seconds)
            _print_table(label, r, base_rate)
        one = results["small, 1 client"] = _measure(address, (1.0,), seconds, SMALL)
        four = results["small, 4 clients"] = _measure(address, (1.0,) * 4, seconds, SMALL)
        print(f"small computations ({SMALL[0]} x tanh(x @ w) on {SMALL[1]}x{SMALL[1]}): 1 client alone "
              f"{one['rate']:,.0f} completions/s, 4 clients together {four['rate']:,.0f} completions/s "
              f"({four['rate'] / one['rate']:.2f}x)", flush=True)
        return results
    finally:
        if cluster is not None:
            cluster.stop()


def _ms(r: dict) -> str:
    done = sum(r["completed"])
    return f"{1e3 * sum(r['device_seconds']) / done:.2f}" if done else "-"


def _measure(address: str, weights: tuple[float, ...], seconds: float,
             computation: tuple[int, int] = (STEPS, SIZE)) -> dict:
    from pathways.cluster import PARENT_PID_ENV, status

    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}  # clients exit if this process dies
    procs = [subprocess.Popen([sys.executable, "-m", "pathways.bench.share", "--client", address, str(w),
                               *map(str, computation)],
                              stdout=subprocess.PIPE, env=env) for w in weights]
    try:
        sessions = _wait_ready(procs, _START_TIMEOUT)
        time.sleep(_SETTLE_SECONDS)
        t0, a = time.monotonic(), _by_session(status(address))
        t1, b, idle, samples = t0, a, [0] * len(sessions), 0
        while t1 < t0 + seconds:
            # Sampled along the way to check saturation: a client with nothing queued
            # leaves its share to the others, which would be no fault of the scheduler.
            time.sleep(min(_POLL_SECONDS, t0 + seconds - t1))
            t1, b = time.monotonic(), _by_session(status(address))
            samples += 1
            idle = [n + (b[s]["queued"] == 0) for n, s in zip(idle, sessions)]
        dead = [p.args[-3] for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"client(s) of weight {', '.join(dead)} exited during the measurement")
    finally:
        _reap(procs)
    elapsed = t1 - t0
    device = [b[s]["device_seconds"] - a[s]["device_seconds"] for s in sessions]
    completed = [b[s]["completed"] - a[s]["completed"] for s in sessions]
    return {"weights": weights, "sessions": sessions, "device_seconds": device, "completed": completed,
            "idle": [n / samples for n in idle], "elapsed": elapsed, "rate": sum(completed) / elapsed,
            "busy": sum(device) / elapsed}


def _by_session(st: dict) -> dict[int, dict]:
    return {s["session"]: s for s in st["sessions"]}


def _wait_ready(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Each client's session id, read from its ready line, in the order of ``procs``."""
    deadline = time.monotonic() + timeout
    buffers = {p.stdout.fileno(): b"" for p in procs}
    sessions: dict[int, int] = {}
    with selectors.DefaultSelector() as sel:
        for p in procs:
            sel.register(p.stdout, selectors.EVENT_READ, p)
        while len(sessions) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"only {len(sessions)} of {len(procs)} clients were ready within {timeout:.0f} s")
            for key, _ in sel.select(left):
                p, fd = key.data, key.fileobj.fileno()
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"a client of weight {p.args[-3]} exited with code {p.wait(_GRACE_SECONDS)} "
                                       "before it was ready")
                buffers[fd] += chunk
                for line in buffers[fd].decode().split("\n")[:-1]:  # whole lines only
                    if line.startswith(READY):
                        sessions[fd] = int(line.split()[1])
                        sel.unregister(key.fileobj)
    return [sessions[p.stdout.fileno()] for p in procs]


def _reap(procs: list[subprocess.Popen]) -> None:
    # JAX processes may ignore SIGTERM while busy, hence the SIGKILL after a grace period.
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(_GRACE_SECONDS)
    for p in procs:
        p.stdout.close()


def _print_table(label: str, r: dict, base_rate: float) -> None:
    weights, device, completed = r["weights"], r["device_seconds"], r["completed"]
    total_w, total_d, total_c = sum(weights), sum(device), sum(completed)
    errors = []
    print(f"weights {label} ({r['elapsed']:.1f} s):\n")
    print("| client | session | weight | target share | device-time share | completions share | rel. error "
          "| none queued |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (sid, w, d, c, idle) in enumerate(zip(r["sessions"], weights, device, completed, r["idle"])):
        target = w / total_w
        share = d / total_d if total_d else 0.0
        errors.append(abs(share - target) / target)
        print(f"| {i} | {sid} | {w:g} | {target:.3f} | {share:.3f} | "
              f"{c / total_c if total_c else 0.0:.3f} | {errors[-1]:.1%} | {idle:.0%} |")
    print(f"\nnone queued: share of status samples (every {_POLL_SECONDS:g} s) in which the client had no "
          "run waiting; 0% means it kept the island saturated")
    print(f"max relative error of device-time shares: {max(errors):.1%}; "
          f"device busy {r['busy']:.0%}, {_ms(r)} ms of device time per run; "
          f"{len(weights)} clients together: {r['rate']:,.0f} completions/s "
          f"({r['rate'] / base_rate:.2f}x one client alone)\n", flush=True)


def client(address: str, weight: float, steps: int = STEPS, size: int = SIZE) -> None:
    """Saturate the island: submit runs forever, keeping OUTSTANDING of them unwaited."""
    import jax
    import jax.numpy as jnp

    import pathways as pw
    from pathways.cluster import exit_with_parent

    exit_with_parent()
    session = pw.connect(address, weight=weight)
    s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
    step = pw.jit(lambda x, w: jax.lax.fori_loop(0, steps, lambda i, v: jnp.tanh(v @ w), x), mesh=s.mesh("x"))
    rng = np.random.default_rng(0)
    x = pw.device_put(rng.standard_normal((size, size), np.float32), s.devices)
    w = pw.device_put(rng.standard_normal((size, size), np.float32) / np.sqrt(size), s.devices)
    step(x, w).block_until_ready(timeout=_START_TIMEOUT)  # compiles on the worker
    pending = deque(step(x, w) for _ in range(OUTSTANDING))
    print(f"{READY} {session.id}", flush=True)  # once: the parent stops reading the pipe after it
    while True:
        pending.popleft().block_until_ready(timeout=_START_TIMEOUT)
        pending.append(step(x, w))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a client of the share benchmark")
    parser.add_argument("--client", nargs=4, metavar=("ADDRESS", "WEIGHT", "STEPS", "SIZE"), required=True)
    args = parser.parse_args()
    client(args.client[0], float(args.client[1]), int(args.client[2]), int(args.client[3]))
