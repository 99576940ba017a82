"""A chaos run: clients keep a mixed workload going on a local cluster while workers are
killed at random and the local supervisor starts them again.

Three clients (processes of their own) loop over op-by-op calls on a
two-host island (a psum over both hosts), a ``@pw.program`` across two islands (a psum on
one, its result moved to the other and computed on there) and transfers (a put, a fetch).
Meanwhile a chaos loop SIGKILLs a random worker every ``kill_every`` seconds (jittered);
the supervisor restarts it and its island heals. Every result is checked: it must be the
right value or fail with ``WorkerLostError``; anything else, or a wait that runs past its
bound, is a failure. At the end, once the kills stop: every island is healthy again and
serves every client, the workers hold no array once the sessions closed (nothing leaked),
and the controller's and workers' memory is what it was after the warm-up. Used by tests/test_chaos.py and ``bench elastic``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

import pathways as pw
from pathways_bench import report
from pathways.cluster import status, stop_processes, worker_stats

RESULT_SECONDS = 60.0  # the bound on any one result: past it, the run counts as hung
_START_SECONDS = 120.0  # a client process's start and warm-up
HEAL_SECONDS = 90.0  # how long the islands may take to be healthy once the kills stop
# The controller's memory may grow by this much from after the warm-up to the end: its
# tables hold only live state, so a longer run must not need more.
MEMORY_SLACK_BYTES = 64 << 20


@dataclasses.dataclass
class ChaosResult:
    duration: float
    kills: int
    restarts: int
    correct: int = 0
    lost: int = 0  # results that failed with WorkerLostError
    failures: list[str] = dataclasses.field(default_factory=list)  # anything else: a wrong value, an error, a hang
    healed_after: Optional[float] = None  # seconds from the last kill to every island healthy
    # worker address -> {session (0: the controller's transfer copies): arrays it still holds}
    leaked: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    controller_rss: tuple[int, int] = (0, 0)  # bytes after the warm-up, and at the end
    worker_rss: tuple[int, int] = (0, 0)  # all workers together: after the warm-up, and at the end

    @property
    def memory_grew(self) -> int:
        return self.controller_rss[1] - self.controller_rss[0]


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class _Workload:
    """One client's workload (in a client process of its own: ``python -m
    pathways_bench.chaos``), on the default session."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.correct = self.lost = 0
        self.failures: list[str] = []
        vds = pw.make_virtual_device_set()
        self.pair = vds.add_slice(cpu_devices=2, island=0)
        self.single = vds.add_slice(cpu_devices=1, island=1)
        self.psum = pw.pmap(lambda x: _psum(x) + 1.0, devices=self.pair.devices, axis_name="i")
        self.triple = pw.jit(lambda x: x * 3.0, mesh=self.single.mesh("x"))
        psum, triple = self.psum, self.triple
        self.across = pw.program(lambda x: triple(psum(x)))

    def warm_up(self) -> None:
        """Every function compiled and every program run once, before any kill."""
        check(self.psum, self.across)
        np.testing.assert_array_equal(np.asarray(self.triple(np.ones(3, np.float32))), [3.0, 3.0, 3.0])

    def step(self) -> None:
        a, b = float(self.rng.randrange(100)), float(self.rng.randrange(100))
        x = np.array([a, b], np.float32)
        kind = self.rng.choice(("op", "program", "transfer"))
        if kind == "op":
            self._check(lambda: np.asarray(self.psum(x)), np.full(2, a + b + 1.0, np.float32), kind)
        elif kind == "program":
            self._check(lambda: np.asarray(self.across(x)), np.full(2, 3.0 * (a + b + 1.0), np.float32), kind)
        else:
            target = self.rng.choice((self.pair, self.single))
            value = np.arange(target.count * 4, dtype=np.float32) + a
            self._check(lambda: pw.device_get(pw.device_put(value, target.devices)), value, kind)

    def _check(self, compute: Callable[[], Any], expected: np.ndarray, kind: str) -> None:
        started = time.monotonic()
        try:
            got = compute()
        except pw.WorkerLostError:
            self.lost += 1
            return
        except Exception as e:  # a failure the chaos run reports, whatever it is
            self.failures.append(f"{kind}: {type(e).__name__}: {e}"[:400])
            return
        took = time.monotonic() - started
        if took > RESULT_SECONDS:
            self.failures.append(f"{kind}: took {took:.1f} s")
        elif not np.array_equal(np.asarray(got), expected):
            self.failures.append(f"{kind}: got {got!r}, expected {expected!r}")
        else:
            self.correct += 1


def check(psum: Any, across: Any) -> None:
    """A psum over island 0's two hosts, and a program from there to island 1, give the
    right values (raises AssertionError or the run's error)."""
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(np.asarray(psum(x)), [4.0, 4.0])
    np.testing.assert_array_equal(np.asarray(across(x)), [12.0, 12.0])


def _psum(x: Any) -> Any:
    import jax

    return jax.lax.psum(x, "i")


def _client_main(address: str, seed: int, seconds: float) -> None:
    """A chaos client process: warm up, say "ready", run the workload for ``seconds``,
    print what happened as one JSON line."""
    pw.connect(address).result_timeout = RESULT_SECONDS  # a result that takes longer fails, as a hang
    work = _Workload(seed)
    work.warm_up()
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        work.step()
    print(json.dumps({"correct": work.correct, "lost": work.lost, "failures": work.failures}), flush=True)
    pw.disconnect()


def run(duration: float = 60.0, kill_every: float = 6.0, clients: int = 3, seed: int = 0,
        on_kill: Callable[[int], None] = lambda kills: None) -> ChaosResult:
    """Run the chaos workload for ``duration`` seconds on a fresh local cluster (an island
    of two hosts, an island of one; the supervisor restarts dead workers), with ``clients``
    client processes, and return what happened. Nothing here asserts: the caller judges."""
    rng = random.Random(seed)
    result = ChaosResult(duration, 0, 0)
    with pw.local_cluster(islands=[pw.Island(hosts=2), pw.Island(hosts=1)], restart_workers=True) as cluster:
        team = [subprocess.Popen([sys.executable, "-m", "pathways_bench.chaos", cluster.address, str(seed + 1 + i),
                                  repr(duration)], stdout=subprocess.PIPE, text=True) for i in range(clients)]
        try:
            for c in team:
                if report.read_line(c, _START_SECONDS, "a chaos client") != "ready":
                    raise RuntimeError("a chaos client did not start")
            controller_pid = cluster.pids[0]
            rss_start = _rss(controller_pid), _workers_rss(cluster.address)
            deadline = time.monotonic() + duration
            last_kill = time.monotonic()
            while True:
                time.sleep(kill_every * rng.uniform(0.5, 1.5))
                if time.monotonic() >= deadline:
                    break
                try:  # the worker process itself, not its keeper
                    os.kill(rng.choice([w["pid"] for w in status(cluster.address)["workers"]]), signal.SIGKILL)
                except (ProcessLookupError, IndexError):  # it was being restarted, or none is attached
                    continue
                result.kills += 1
                last_kill = time.monotonic()
                on_kill(result.kills)
            for i, c in enumerate(team):
                try:
                    line = report.read_line(c, max(1.0, deadline - time.monotonic()) + RESULT_SECONDS + 30,
                                            f"chaos client {i}")
                    told = json.loads(line)
                except (TimeoutError, RuntimeError, ValueError) as e:
                    result.failures.append(f"client {i} did not report: {e}")
                    continue
                result.correct += told["correct"]
                result.lost += told["lost"]
                result.failures.extend(f"client {i}: {f}" for f in told["failures"])
            healthy = _wait_healthy(cluster.address, HEAL_SECONDS)
            result.healed_after = healthy - last_kill if healthy is not None else None
            if healthy is not None:
                try:  # once healed, the island serves the same functions again
                    check(*_functions())
                except Exception as e:  # reported, not raised
                    result.failures.append(f"after healing: {type(e).__name__}: {e}"[:400])
        finally:
            stop_processes(team)
        result.restarts = cluster.restarts
        gc.collect()
        result.leaked = _leaked(cluster.address)
        result.controller_rss = (rss_start[0], _rss(controller_pid))
        result.worker_rss = (rss_start[1], _workers_rss(cluster.address))
    return result


def _functions() -> tuple[Any, Any]:
    vds = pw.make_virtual_device_set()
    pair, single = vds.add_slice(cpu_devices=2, island=0), vds.add_slice(cpu_devices=1, island=1)
    psum = pw.pmap(lambda x: _psum(x) + 1.0, devices=pair.devices, axis_name="i")
    triple = pw.jit(lambda x: x * 3.0, mesh=single.mesh("x"))
    return psum, pw.program(lambda x: triple(psum(x)))


def _workers_rss(address: str) -> int:
    return sum(_rss(w["pid"]) for w in status(address)["workers"])  # the workers, not their keepers


def _wait_healthy(address: str, timeout: float) -> Optional[float]:
    """The time every island is healthy (monotonic), or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(address)
        if st["islands"] and all(i["healthy"] and not i["assembling"] for i in st["islands"]):
            return time.monotonic()
        time.sleep(0.1)
    return None


def _leaked(address: str, settle: float = 10.0) -> dict[str, dict[int, int]]:
    """Arrays the workers still hold once every client session closed (none should remain:
    a closed session's arrays are dropped), by session. Waits up to ``settle`` seconds for
    the drops."""
    deadline = time.monotonic() + settle
    while True:
        held = {w["address"]: worker_stats(w["address"])["sessions"] for w in status(address)["workers"]}
        held = {a: {int(s): n for s, n in sessions.items()} for a, sessions in held.items() if sessions}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


if __name__ == "__main__":
    _client_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
