"""``python -m pathways bench tenancy``: many clients sharing devices (the paper's Figures 8
and 9).

One local cluster (one island, one host, one CPU device, policy ``fair``) and eleven client
processes, started once: eight of weight 1 and three of weights 2, 4 and 8. Each client
connects with its weight, takes a 1-device slice (so all share the same device) and compiles
two computations: *small* (one 8x8 step, microseconds: dispatch-bound) and *large*
(``tanh(x @ w)`` steps on 256x256, a few ms). On command a client submits one of them
continuously, keeping ``OUTSTANDING`` runs in flight, until told to pause.

- Figure 8: aggregate throughput of 1, 2, 4 and 8 clients running at once, for both
  computations, alternating the client counts within each round; the baseline is one client.
- Figure 9: device-time shares of four clients with weights 1:1:1:1 and 1:2:4:8, from the
  controller's per-session accounting over a measurement window.

Completions and device time come from the controller's ``status()``, read before and after
each window.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Optional

import numpy as np

from pathways_bench import report

TITLE = "Multi-tenancy: clients sharing one device"
PAPER = "Figures 8 and 9"
PAPER_RESULT = ("concurrent clients together reach at least one client's throughput (Figure 8), and device "
                "time follows the clients' weights 1:1:1:1 and 1:2:4:8 (Figure 9)")
ROUNDS = 3
CLIENTS = (1, 2, 4, 8)
WEIGHT_SETS: tuple[tuple[int, ...], ...] = ((1, 1, 1, 1), (1, 2, 4, 8))
COMPUTATIONS = {"small": (1, 8), "large": (8, 256)}  # (steps, size) of tanh(x @ w)
OUTSTANDING = 16  # runs per client submitted and not yet waited for: enough to stay queued
READY, RUNNING, PAUSED = "ready", "running", "paused"
_TIMEOUT = 180.0
_SETTLE_SECONDS = 0.5

ABOUT = f"""
One CPU device (one host) shared by client processes, each with its own slice of it and
{OUTSTANDING} runs in flight. *small* is one 8x8 `tanh(x @ w)` (dispatch-bound), *large* eight
256x256 steps (a few ms). Figure 8: aggregate completions per second of 1, 2, 4 and 8 clients
running at once, alternated within each round; the baseline is one client alone. Figure 9:
device-time shares of four clients weighted 1:1:1:1 and 1:2:4:8 under the `fair` policy,
from the controller's accounting.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    from pathways.cluster import Island, LocalCluster

    clients = CLIENTS[:2] if tiny else CLIENTS
    window = 0.5 if tiny else 2.0
    share_window = 2.0 if tiny else 8.0
    progress.expect(1 + rounds * len(clients) * len(COMPUTATIONS) + len(WEIGHT_SETS))
    cluster = LocalCluster([Island(1, 1)], policy="fair").start()
    assert cluster.address is not None
    ones = max(max(clients), *(ws.count(1) for ws in WEIGHT_SETS))
    weights = [1] * ones + sorted({w for ws in WEIGHT_SETS for w in ws if w != 1})
    try:
        progress.step(f"starting {len(weights)} clients")
        with _Clients(cluster.address, weights) as pool:
            samples: dict[str, dict[int, list[float]]] = {c: {k: [] for k in clients} for c in COMPUTATIONS}
            for r in range(rounds):
                for comp in COMPUTATIONS:
                    for k in clients:
                        progress.step(f"{k} client(s), {comp} (round {r + 1}/{rounds})")
                        samples[comp][k].append(pool.window(list(range(k)), comp, window)["rate"])
            shares = {}
            for ws in WEIGHT_SETS:
                progress.step("weights " + ":".join(map(str, ws)))
                chosen = _choose(weights, ws)
                shares[":".join(map(str, ws))] = pool.window(chosen, "large", share_window)
    finally:
        cluster.stop()
    return {"clients": list(clients), "window_s": window, "share_window_s": share_window,
            "rates": {c: {str(k): report.stats(v) for k, v in by_k.items()} for c, by_k in samples.items()},
            "shares": shares}


def _choose(weights: list[int], wanted: tuple[int, ...]) -> list[int]:
    """Indices of distinct clients with the wanted weights."""
    free = list(range(len(weights)))
    chosen = []
    for w in wanted:
        i = next(i for i in free if weights[i] == w)
        free.remove(i)
        chosen.append(i)
    return chosen


class _Clients:
    """Client processes driven over their stdin/stdout."""

    def __init__(self, address: str, weights: list[int]):
        from pathways import config

        self.address = address
        self.weights = weights
        env = {**os.environ, config.PARENT_PID.name: str(os.getpid())}  # clients exit if this process dies
        self.procs = [subprocess.Popen([sys.executable, "-m", "pathways_bench.tenancy", "--client", address, str(w)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
                      for w in weights]
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(len(self.procs))]
        for t in self._readers:
            t.start()
        self.sessions = [int(line.split()[1]) for line in self._expect(range(len(self.procs)), READY)]

    def _read(self, i: int) -> None:
        for line in self.procs[i].stdout:
            self.lines.put((i, line.strip()))
        self.lines.put((i, ""))  # end of output: the client exited

    def _expect(self, which, word: str) -> list[str]:
        """The next line starting with ``word`` from each client in ``which``, in that order."""
        which = list(which)
        got: dict[int, str] = {}
        deadline = time.monotonic() + _TIMEOUT
        while len(got) < len(which):
            try:
                i, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"clients {sorted(set(which) - set(got))} did not say {word!r} "
                                   f"within {_TIMEOUT:.0f} s") from None
            if not line:
                raise RuntimeError(f"client {i} (weight {self.weights[i]}) exited with code "
                                   f"{self.procs[i].wait(5)}")
            if i in which and line.startswith(word):
                got[i] = line
        return [got[i] for i in which]

    def _tell(self, which, command: str) -> None:
        for i in which:
            self.procs[i].stdin.write(command + "\n")
            self.procs[i].stdin.flush()

    def window(self, which: list[int], computation: str, seconds: float) -> dict:
        """Run ``computation`` on clients ``which`` for ``seconds``; per-client completions and
        device seconds over the window, and the aggregate rate."""
        from pathways.cluster import status

        self._tell(which, f"run {computation}")
        self._expect(which, RUNNING)  # every client has its runs queued
        time.sleep(_SETTLE_SECONDS)  # and the scheduler has reached its steady order
        t0, a = time.monotonic(), _by_session(status(self.address))
        time.sleep(seconds)
        t1, b = time.monotonic(), _by_session(status(self.address))
        self._tell(which, "pause")
        self._expect(which, PAUSED)
        sessions = [self.sessions[i] for i in which]
        completed = [b[s]["completed"] - a[s]["completed"] for s in sessions]
        device = [b[s]["device_seconds"] - a[s]["device_seconds"] for s in sessions]
        return {"weights": [self.weights[i] for i in which], "completed": completed, "device_seconds": device,
                "elapsed": t1 - t0, "rate": sum(completed) / (t1 - t0)}

    def __enter__(self) -> "_Clients":
        return self

    def __exit__(self, *exc) -> None:
        from pathways.cluster import stop_processes

        for p in self.procs:
            try:
                p.stdin.write("exit\n")
                p.stdin.close()
            except OSError:
                pass
        stop_processes(self.procs)


def _by_session(st: dict) -> dict[int, dict]:
    return {s["session"]: s for s in st["sessions"]}


def client(address: str, weight: float) -> None:
    """A tenant: compile both computations, then run or pause as told on stdin."""
    import jax
    import jax.numpy as jnp

    import pathways as pw
    from pathways.keeper import exit_with_parent

    exit_with_parent()
    session = pw.connect(address, weight=weight)
    s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
    rng = np.random.default_rng(0)
    programs = {}
    for name, (steps, size) in COMPUTATIONS.items():
        fn = pw.jit(lambda x, w, steps=steps: jax.lax.fori_loop(0, steps, lambda i, v: jnp.tanh(v @ w), x),
                    mesh=s.mesh("x"))
        x = pw.device_put(rng.standard_normal((size, size), np.float32), s.devices)
        w = pw.device_put(rng.standard_normal((size, size), np.float32) / np.sqrt(size), s.devices)
        fn(x, w).block_until_ready(timeout=_TIMEOUT)  # compiles on the worker
        programs[name] = (fn, x, w)
    state: dict[str, Optional[str]] = {"run": None}
    changed = threading.Condition()
    announced = [False]  # said RUNNING since the last pause

    def submit() -> None:
        pending: deque = deque()
        while True:
            with changed:
                current = state["run"]
                if current is None:
                    announced[0] = False
                    while pending:
                        pending.popleft().block_until_ready(timeout=_TIMEOUT)
                    print(PAUSED, flush=True)
                    while state["run"] is None:
                        changed.wait()
                    continue
            fn, x, w = programs[current]
            while len(pending) >= OUTSTANDING:
                pending.popleft().block_until_ready(timeout=_TIMEOUT)
            pending.append(fn(x, w))
            if len(pending) == OUTSTANDING and not announced[0]:
                announced[0] = True
                print(RUNNING, flush=True)

    runner = threading.Thread(target=submit, daemon=True)
    print(f"{READY} {session.id}", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "exit":
            break
        with changed:
            state["run"] = command[1] if command[0] == "run" else None
            changed.notify()
        if not runner.is_alive():
            runner.start()
    pw.disconnect()


def tables(data: dict) -> list[report.Table]:
    out = []
    for comp in COMPUTATIONS:
        rates = data["rates"][comp]
        base = rates[str(data["clients"][0])]
        rows = [[str(k), report.rate(rates[str(k)]), report.times(report.ratio(rates[str(k)], base))]
                for k in data["clients"]]
        out.append(report.Table(f"{comp} computation: aggregate completions per second",
                                ["clients", "completions/s", "vs 1 client"], rows))
    for label, r in data["shares"].items():
        total_w, total_d = sum(r["weights"]), sum(r["device_seconds"]) or 1.0
        rows = [[str(i), str(w), f"{w / total_w:.3f}", f"{d / total_d:.3f}",
                 f"{abs(d / total_d - w / total_w) / (w / total_w):.1%}"]
                for i, (w, d) in enumerate(zip(r["weights"], r["device_seconds"]))]
        out.append(report.Table(f"weights {label}: device-time shares over {r['elapsed']:.1f} s",
                                ["client", "weight", "target", "measured", "rel. error"], rows))
    return out


def share_error(r: dict) -> float:
    total_w, total_d = sum(r["weights"]), sum(r["device_seconds"]) or 1.0
    return max(abs(d / total_d - w / total_w) / (w / total_w) for w, d in zip(r["weights"], r["device_seconds"]))


def summary(data: dict) -> list[str]:
    lines = []
    for comp in COMPUTATIONS:
        rates = data["rates"][comp]
        k = str(data["clients"][-1])
        x = report.ratio(rates[k], rates[str(data["clients"][0])])
        lines.append(f"{comp}: {k} clients together reach {x:.2f}x the throughput of one client alone")
    for label, r in data["shares"].items():
        lines.append(f"weights {label}: largest relative error of a device-time share {share_error(r):.1%}")
    return lines


def notes(data: dict) -> str:
    return """
The controller's gang scheduler orders every client's runs on the island and the `fair`
policy charges each client its measured device time over its weight (stride scheduling), so
shares follow the weights as long as every client keeps work queued. With small
computations the device is never the bottleneck: each client is bound by its own submission
cost, and on 2 cores more client processes also take CPU from the worker.
"""


def plot(data: dict, path: str) -> None:
    series = [(comp, data["clients"], [report.ratio(data["rates"][comp][str(k)], data["rates"][comp][str(data["clients"][0])])
                                       for k in data["clients"]]) for comp in COMPUTATIONS]
    report.plot_lines(path, "Aggregate throughput of concurrent clients (Figure 8)", "clients",
                      "throughput vs one client", series, hline=1.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a client of the tenancy benchmark")
    parser.add_argument("--client", nargs=2, metavar=("ADDRESS", "WEIGHT"), required=True)
    args = parser.parse_args()
    client(args.client[0], float(args.client[1]))
