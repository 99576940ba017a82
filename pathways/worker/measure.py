"""What a worker measures about itself for placement and planning: its FLOP/s, its memory,
and the latency and bandwidth of its links to the other workers.

One background thread does the measurements in turn, so that they never compete with each
other, and reports each job's figures as a ``Measured`` message. A job is cheap, since a
local cluster of 16 workers on two cores measures itself all at once when it starts: for
the FLOP/s, compiling a small matmul once per device and six rounds of it (0.2 GFLOP per
device), and per peer one connection, five empty round trips and two transfers of 512 KiB
over the data plane (wire/tcp.py's probe). A peer that does not answer within
PROBE_TIMEOUT seconds is reported unmeasured.
"""

from __future__ import annotations

import logging
import queue
import statistics
import time
from typing import Any, Callable

import numpy as np

from pathways.errors import ConnectError, WireError
from pathways.protocol.messages import Measured
from pathways.threads import Threads
from pathways.wire import tcp
from pathways.wire.codec import host_memory_bytes
from pathways.wire.security import Security

log = logging.getLogger("pathways.worker")

MATMUL_SIZE = 256  # 34 MFLOP per device per round: about a millisecond on a CPU core
MATMUL_ROUNDS = 5
PROBE_TIMEOUT = 2.0
PROBE_BYTES = 512 * 1024


def measure_flops(jax: Any, devices: list, n: int = MATMUL_SIZE, rounds: int = MATMUL_ROUNDS) -> float:
    """The host's float32 FLOP/s: an ``n`` x ``n`` matmul on every one of ``devices`` at
    once (the CPU devices of a host share its cores, so running them together measures what
    the host can do, where timing one and multiplying would count the cores once per
    device), the median of ``rounds`` rounds after a warm-up that compiles it."""
    square = jax.jit(lambda a: a @ a)
    xs = [jax.device_put(np.full((n, n), 1.0 / n, np.float32), d) for d in devices]
    jax.block_until_ready([square(x) for x in xs])
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([square(x) for x in xs])
        times.append(time.perf_counter() - start)
    return len(devices) * 2.0 * n ** 3 / statistics.median(times)


class Measurer:
    """Runs measurement jobs on one background thread and hands each job's ``measured``
    message to ``report``."""

    def __init__(self, jax: Any, report: Callable[[Measured], None], probe_timeout: float = PROBE_TIMEOUT,
                 security: Security | None = None, tickets: tcp.Tickets | None = None) -> None:
        self._jax = jax
        self._security = security
        self._tickets = tickets
        self._report = report
        self._probe_timeout = probe_timeout
        self._flops: float | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = Threads("the worker's measurer")
        self._threads.start(self._loop, "pathways-measure")

    def request(self, job: int, flops: bool, peers: dict[int, str]) -> None:
        """Measure (the FLOP/s if ``flops``, and the link to each of ``peers``: worker ->
        data address) and report it as job ``job``."""
        self._jobs.put((job, flops, dict(peers)))

    def stop(self) -> None:
        """End the thread after the job it runs (each bounded by its probe timeout)."""
        self._jobs.put(None)
        self._threads.join()

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, flops, peers = item
            if flops:
                try:
                    self._flops = measure_flops(self._jax, self._jax.local_devices())
                except Exception:  # the figure stays what it was; the links still get measured
                    log.exception("measuring this host's FLOP/s failed")
            links = []
            for peer, address in sorted(peers.items()):
                try:
                    ticket = self._tickets(address) if self._tickets is not None else None
                    latency, bandwidth = tcp.probe(address, self._probe_timeout, PROBE_BYTES, security=self._security,
                                                   ticket=ticket)
                except (OSError, ValueError, WireError, ConnectError) as e:  # ValueError: a malformed address
                    log.info("the link to worker %d at %s stays unmeasured: %s", peer, address, e)
                    links.append((peer, None, None))
                else:
                    links.append((peer, latency, bandwidth))
            self._report(Measured(job, self._flops, host_memory_bytes(), tuple(links)))
