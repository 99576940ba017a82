"""``python -m pathways bench elastic``: how fast the runtime heals, and what suspending a
session costs.

- *Heal*: on a local cluster of one island of two hosts whose supervisor restarts dead
  workers, a client keeps a psum compiled for the island. A worker is SIGKILLed (rank 0 and
  rank 1 in turn); the time from the kill until the same compiled function, called again
  and again, returns the right value. Beside it, what the alternative costs: starting a
  fresh cluster of the same shape and running the psum on it.
- *Suspend and resume*: a session holding 1 GiB on one island is suspended, another client
  takes the island, and the session resumes on the other island (pathways_bench/suspend.py),
  next to a raw copy of the same bytes.
- *Chaos*: the chaos run of tests/test_chaos.py (pathways_bench/chaos.py), longer.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

import pathways as pw
from pathways_bench import chaos, report
from pathways.cluster import RESTART_STABLE_SECONDS, status

TITLE = "Elastic islands: from a lost host to serving again, suspend and resume, chaos"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5
CHAOS_SECONDS, TINY_CHAOS_SECONDS = 180.0, 15.0
SUSPEND_GIB, TINY_SUSPEND_GIB = 1.0, 0.0625
_SERVE_TIMEOUT = 120.0

ABOUT = f"""
**Heal**: a local cluster of one island of two hosts (one CPU device each), started with
`restart_workers=True`; a client compiles a psum over both hosts (`pw.pmap`). Each round
SIGKILLs one worker (rank 0, which runs the island's jax.distributed coordinator, and rank 1
in turn) and calls the same compiled function every 50 ms until it returns the right value:
*kill to serving* is that time. It includes the supervisor's restart (its first back-off is
0.5 s; each round waits {RESTART_STABLE_SECONDS:g} s after healing, so that every restart is a first one),
the new process's start and JAX import, the surviving host's restart by its keeper, the
island's new jax.distributed group, and recompiling the function. *Fresh cluster* is the
alternative without healing: `pw.local_cluster` of the same shape started anew and the psum
compiled and run on it.

**Suspend and resume**: arrays totalling {SUSPEND_GIB:g} GiB on island 0 of a cluster of two
one-host islands; `session.suspend()` moves them into the workers' host memory and releases
the slices, another client takes island 0 exclusively, and `session.resume()` re-places the
slices on island 1 and moves the bytes there worker to worker (`pathways_bench/suspend.py`).
*Raw copy* is a numpy copy of the same bytes in one process's memory, the floor for moving
them off a device on CPU; *raw move* is an ordinary program moving arrays of the same bytes
from island 0 to island 1, the data plane's worker-to-worker transfer.

**Chaos**: three client processes run op-by-op psums, programs across both islands and
transfers for {CHAOS_SECONDS:g} s while a worker is SIGKILLed every 7 s on average (see
`pathways_bench/chaos.py`): every result must be right or `WorkerLostError`, nothing may
hang, every island must be healthy at the end, the workers must hold no array once the
sessions closed, and memory must be flat.
"""


def _psum(x: Any) -> Any:
    import jax

    return jax.lax.psum(x, "i")


def _serving(total: Any, x: np.ndarray, expected: np.ndarray, timeout: float) -> float:
    """Call ``total(x)`` until it gives ``expected``; returns the time it did (monotonic)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if np.array_equal(np.asarray(total(x)), expected):
                return time.monotonic()
        except (pw.WorkerLostError, pw.RemoteError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the island did not serve again within {timeout:g} s")
        time.sleep(0.05)


def _heal_rounds(rounds: int, progress: report.Progress) -> dict[str, list[float]]:
    x = np.array([1.0, 2.0], np.float32)
    expected = np.array([4.0, 4.0], np.float32)
    heal: list[float] = []
    fresh: list[float] = []
    with pw.local_cluster(islands=[pw.Island(hosts=2)], restart_workers=True) as c:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
        total = pw.pmap(lambda v: _psum(v) + 1.0, devices=s.devices, axis_name="i")
        _serving(total, x, expected, _SERVE_TIMEOUT)
        for i in range(rounds):
            rank = i % 2
            pid = next(w["pid"] for w in status(c.address)["workers"] if w["rank"] == rank)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            heal.append(_serving(total, x, expected, _SERVE_TIMEOUT) - killed)
            progress.step(f"heal round {i + 1}: {heal[-1]:.1f} s")
            if i + 1 < rounds:
                time.sleep(RESTART_STABLE_SECONDS)  # the next restart is a first one again
    for i in range(rounds):
        began = time.monotonic()
        with pw.local_cluster(islands=[pw.Island(hosts=2)]):
            s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
            total = pw.pmap(lambda v: _psum(v) + 1.0, devices=s.devices, axis_name="i")
            fresh.append(_serving(total, x, expected, _SERVE_TIMEOUT) - began)
        progress.step(f"fresh cluster round {i + 1}: {fresh[-1]:.1f} s")
    return {"heal": heal, "fresh": fresh}


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    from pathways_bench import suspend

    progress.expect(2 * rounds + 2)
    heal = _heal_rounds(rounds, progress)
    moved = suspend.measure(TINY_SUSPEND_GIB if tiny else SUSPEND_GIB, rounds)
    progress.step("suspend and resume")
    seconds = TINY_CHAOS_SECONDS if tiny else CHAOS_SECONDS
    result = chaos.run(duration=seconds, kill_every=7.0, clients=3, seed=2)
    progress.step("chaos")
    return {"heal_s": report.stats(heal["heal"]), "fresh_s": report.stats(heal["fresh"]),
            "suspend": moved,
            "chaos": {"seconds": seconds, "kills": result.kills, "restarts": result.restarts,
                      "correct": result.correct, "lost": result.lost, "failures": result.failures,
                      "healed_after_s": result.healed_after, "leaked": result.leaked,
                      "controller_rss": list(result.controller_rss), "worker_rss": list(result.worker_rss)}}


def _s(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def tables(data: dict) -> list:
    sus = data["suspend"]
    chaos_data = data["chaos"]
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    return [
        report.Table("Heal: seconds from SIGKILL of a worker to the same compiled psum serving again, median (min-max)",
                     ["case", "seconds"],
                     [["kill to serving (supervisor restarts the worker)", _s(data["heal_s"])],
                      ["fresh cluster of the same shape: start to serving", _s(data["fresh_s"])]]),
        report.Table(f"Suspend and resume a session holding {sus['bytes'] / 2**30:g} GiB, seconds, median of "
                     f"{sus['rounds']} rounds",
                     ["step", "seconds", "GiB/s"],
                     [[name, f"{sus[key]:.2f}", f"{sus['bytes'] / 2**30 / sus[key]:.2f}" if sus[key] else "-"]
                      for name, key in (("suspend (device to host memory, slices released)", "suspend_s"),
                                        ("resume on the other island (worker to worker)", "resume_s"),
                                        ("raw copy: numpy copy of the same bytes in one process", "numpy_copy_s"),
                                        ("raw move: the same bytes moved to the other island by a program",
                                         "transfer_s"))]),
        report.Table(f"Chaos: {chaos_data['seconds']:g} s, 3 clients, a worker SIGKILLed every 7 s on average",
                     ["kills", "restarts", "right", "WorkerLostError", "other failures", "healthy after last kill s",
                      "arrays left", "controller RSS MiB start-end", "workers RSS MiB start-end"],
                     [[str(chaos_data["kills"]), str(chaos_data["restarts"]), str(chaos_data["correct"]),
                       str(chaos_data["lost"]), str(len(chaos_data["failures"])),
                       f"{chaos_data['healed_after_s']:.1f}" if chaos_data["healed_after_s"] is not None else "never",
                       str(sum(n for held in chaos_data["leaked"].values() for n in held.values())),
                       f"{mib(chaos_data['controller_rss'][0])}-{mib(chaos_data['controller_rss'][1])}",
                       f"{mib(chaos_data['worker_rss'][0])}-{mib(chaos_data['worker_rss'][1])}"]]),
    ]


def summary(data: dict) -> list[str]:
    sus, c = data["suspend"], data["chaos"]
    lines = [f"an island heals {data['heal_s']['median']:.1f} s (median) after one of its hosts is killed, "
             f"{report.ratio(data['heal_s'], data['fresh_s']):.2f}x the time a fresh cluster of the same shape "
             "takes to serve",
             f"suspending {sus['bytes'] / 2**30:g} GiB takes {sus['suspend_s']:.2f} s and resuming it on another "
             f"island {sus['resume_s']:.2f} s; a numpy copy of the bytes takes {sus['numpy_copy_s']:.2f} s, and "
             f"moving them to the other island with a program {sus['transfer_s']:.2f} s",
             f"chaos: {c['kills']} kills in {c['seconds']:g} s, {c['correct']} right results, {c['lost']} "
             f"WorkerLostError, {len(c['failures'])} other failures, "
             + ("every island healthy again" if c["healed_after_s"] is not None else "an island did not heal")]
    return lines


def notes(data: dict) -> str:
    sus = data["suspend"]
    return """
What a heal costs. A killed host's replacement is a new process: Python, JAX and the
worker start (about 2 s of CPU here), register, and the island's hosts form a new
jax.distributed group; the surviving host's keeper restarts it for that (JAX cannot leave
a group and join another in-process; when rank 0 dies, JAX's coordination client has
already aborted the other hosts, and their keepers restart them all the same). The client's
compiled function is compiled again on the new processes when the island is whole. On 2
cores, these processes compete with each other and with the client, so the figures are
upper bounds for hosts with cores of their own.

Suspend and resume. On CPU, moving an array off its device is a memory copy into the
worker's host memory, for which numpy's copy of the same bytes in one process is the floor
(suspend took {:.1f}x it here). Resume pushes every array of the session from its old
holder at once, over the data plane, where the raw move is one program per array, each
started after the previous one finished (resume took {:.2f}x the raw move here). On this
virtual machine the first gigabyte a process writes into fresh memory costs about 2 s
rather than 0.2 s (a numpy copy of 1 GiB in a new process: 2.5 s, then 0.18 s each time
after), so each worker's first suspend or resume takes seconds and the later ones a
fraction of one; the median of the rounds lands on either side from run to run, while the
raw copy always runs warm.
""".format(sus["suspend_s"] / sus["numpy_copy_s"], sus["resume_s"] / sus["transfer_s"])


def plot(data: dict, path: str) -> None:
    report.plot_bars(path, "Heal: kill to serving vs a fresh cluster", "seconds", ["median"],
                     {"kill to serving": [data["heal_s"]["median"]],
                      "fresh cluster": [data["fresh_s"]["median"]]})
