"""What suspend and resume cost, next to copying the same bytes raw.

A local cluster of two islands of one host each; one session holds arrays totalling
``gib`` GiB on island 0. Each round suspends it (its arrays leave the devices for the
worker's host memory), has another session take island 0 exclusively, and resumes it,
which places its slice on island 1 and moves every byte worker to worker; the other
session then lets island 0 go, and the next round moves the arrays back the other way.

Baselines for the same number of bytes: a numpy copy in this process (a memory copy,
what moving off a device costs at least on CPU), and an ordinary program moving an array
of that size from island 0 to island 1 (the data plane's worker-to-worker transfer).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

import pathways as pw
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session

_ARRAYS = 4  # the bytes are spread over this many arrays
_TIMEOUT = 600.0


def measure(gib: float = 1.0, rounds: int = 3) -> dict[str, Any]:
    """Median seconds of suspend(), of resume() onto the other island, and of the raw
    copies of the same bytes; with the bytes and the rounds."""
    if not gib > 0 or rounds < 1:
        raise ValueError(f"measure needs gib > 0 and rounds >= 1, got gib={gib!r}, rounds={rounds!r}")
    per_array = max(1, int(gib * 2**30) // (4 * _ARRAYS))
    nbytes = per_array * 4 * _ARRAYS
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(per_array, dtype=np.float32) for _ in range(_ARRAYS)]
    suspend_s, resume_s, islands = [], [], []
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=1),
                                   pw.Island(hosts=1, devices_per_host=1)]) as cluster:
        session = Session(cluster.address, connect_timeout=60)
        try:
            s = VirtualDeviceSet(session).add_slice(cpu_devices=1, island=0)
            arrays = [session.put_layout(h, *_whole(s)) for h in host]
            for a in arrays:
                a.block_until_ready(timeout=_TIMEOUT)
            for _ in range(rounds):
                began = time.perf_counter()
                session.suspend(timeout=_TIMEOUT)
                suspend_s.append(time.perf_counter() - began)
                other = Session(cluster.address, connect_timeout=60)
                try:  # the island the arrays were on goes to another client
                    VirtualDeviceSet(other).add_slice(cpu_devices=1, island=s.island, exclusive=True)
                    was = s.island
                    began = time.perf_counter()
                    session.resume(timeout=_TIMEOUT)
                    resume_s.append(time.perf_counter() - began)
                    if s.island == was:
                        raise RuntimeError("resume placed the slice on the island another client holds")
                    islands.append(s.island)
                finally:
                    other.close()
            for a, h in zip(arrays, host):
                if not np.array_equal(np.asarray(a), h):
                    raise RuntimeError("an array came back from suspend and resume with other contents")
            transfer_s = _transfer(session, host[0], rounds)
        finally:
            session.close()
    copy_s = []
    for _ in range(rounds):
        began = time.perf_counter()
        copies = [h.copy() for h in host]
        copy_s.append(time.perf_counter() - began)
        del copies
    return {"bytes": nbytes, "rounds": rounds, "arrays": _ARRAYS,
            "suspend_s": statistics.median(suspend_s), "resume_s": statistics.median(resume_s),
            "numpy_copy_s": statistics.median(copy_s),
            # one array of the session's size would take _ARRAYS times this: arrays are sent one by one
            "transfer_s": statistics.median(transfer_s) * _ARRAYS,
            "resumed_on_islands": islands}


def _whole(s: pw.Slice) -> tuple:
    mesh = s.mesh("x")
    sharding = pw.NamedSharding(mesh, pw.P())
    return sharding.layout(), sharding


def _transfer(session: Session, host: np.ndarray, rounds: int) -> list[float]:
    """Seconds a program takes to move an array of ``host``'s size from island 0 to island 1
    (the first run compiles and is not counted)."""
    sets = VirtualDeviceSet(session)
    a, b = sets.add_slice(cpu_devices=1, island=0), sets.add_slice(cpu_devices=1, island=1)
    ident_a = pw.jit(lambda x: x, mesh=a.mesh("x"))
    ident_b = pw.jit(lambda x: x, mesh=b.mesh("x"))
    src = ident_a(session.put_layout(host, *_whole(a)))
    src.block_until_ready(timeout=_TIMEOUT)

    def hop(x: Any) -> Any:
        return ident_b(x)

    hop(src).block_until_ready(timeout=_TIMEOUT)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        hop(src).block_until_ready(timeout=_TIMEOUT)
        times.append(time.perf_counter() - began)
    return times
