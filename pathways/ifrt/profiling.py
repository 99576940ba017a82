"""Profiles of the workers through the front end: pathwaysutils' profile requests (an IFRT
PluginProgram whose JSON body is ``{"profileRequest": {...}}``, which its ``jax.profiler``
patch compiles at ``start_trace`` and executes twice: once to start, once to stop); a part
of the IFRT session (IfrtSession). The first execution starts XLA's profiler on the hosts
profiled (the first ``maxNumHosts`` of the session's, island by island; 0: all), the
second has each write its trace into the request's location (``traceLocation``, read under
the workers' checkpoint directory as checkpoints are; ``gs://`` names map into it), in the
run named by ``xprofTraceOptions.traceSessionName`` (the client's own trace's run), so that
TensorBoard and xprof show the client's and the workers' traces together."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pathways import errors
from pathways.ifrt import types as t
from pathways.ifrt.handling import IfrtArray, Lazy
from pathways.ifrt.types import IfrtError
from pathways.protocol import messages as m

PROFILE_REQUEST = "profileRequest"
_WAIT_SECONDS = 600.0  # for the hosts to start, or to write their traces


@dataclass
class ProfileProgram:
    """A compiled profile request; ``hosts``: those profiling, between the start and the stop."""

    location: str
    run: str
    max_hosts: int
    result: bool  # whether an execution returns the array the client waits on (xprofTraceOptions)
    hosts: tuple[str, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


def profile_program(request: Any) -> ProfileProgram:
    """The profile program of a plugin program's ``profileRequest``; IfrtError
    INVALID_ARGUMENT naming what is wrong."""
    if not isinstance(request, dict):
        raise t.invalid("a profileRequest must be an object")
    xprof = request.get("xprofTraceOptions")
    if xprof is not None and not isinstance(xprof, dict):
        raise t.invalid("a profileRequest's xprofTraceOptions must be an object")
    location = request.get("traceLocation") or (xprof or {}).get("traceDirectory")
    if not isinstance(location, str) or not 0 < len(location) <= m.MAX_PATH:
        raise t.invalid("a profileRequest needs a traceLocation: the directory its traces go to")
    # the run: the client's (pathwaysutils names it in xprofTraceOptions, worker_traces.py
    # beside the location)
    run = ((xprof or {}).get("traceSessionName") or request.get("traceSessionName")
           or time.strftime("%Y_%m_%d_%H_%M_%S"))
    hosts = request.get("maxNumHosts", 1)
    if not isinstance(run, str) or type(hosts) is not int or hosts < 0:
        raise t.invalid("a profileRequest's traceSessionName must be text and its maxNumHosts a count")
    return ProfileProgram(location, run[:m.MAX_NAME], hosts, xprof is not None)


class ProfilingHosts:
    """IfrtSession's execution of profile programs."""

    def _execute_profile(self, program: ProfileProgram, body: Any) -> Any:
        with program.lock:
            start = not program.hosts
            hosts = self._profiled_hosts(program.max_hosts) if start else program.hosts
            program.hosts = hosts if start else ()
        call = self.native.profile_hosts(hosts, start, program.location, program.run)
        if start:  # a start that failed leaves nothing to stop: the next execution starts again
            call.add_done_callback(lambda f: f.exception() is not None and _forget(program, hosts))

        def wait() -> None:
            try:
                call.result(timeout=_WAIT_SECONDS)
            except FutureTimeout:
                raise IfrtError(t.DEADLINE_EXCEEDED, f"the workers did not {'start' if start else 'stop'} their "
                                                     f"profiler within {_WAIT_SECONDS:g} s") from None
            except errors.PathwaysError as e:
                raise t.runtime_failure(e, "profiling the workers failed: ") from None

        # the one array a request with xprofTraceOptions answers with: held here, for nothing on
        # the workers. (pathwaysutils then waits for neither: its stop returns before the
        # workers have written their traces, as on Cloud.)
        outs = [IfrtArray(np.dtype(bool), (1,), t.replicated((0,)), held=np.zeros(1, bool))] if program.result else []
        return self._executed(outs, body, Lazy(wait))

    def _profiled_hosts(self, max_hosts: int) -> tuple[str, ...]:
        """The first ``max_hosts`` hosts of the session's slices (0: all), island by island, by rank."""
        hosts: dict[int, None] = {}
        for s in sorted(self._table.slices.values(), key=lambda s: (s.island, s.id)):
            hosts.update(dict.fromkeys(s.workers))
        workers = list(hosts)[:max_hosts or None]
        return self._table.book.of(workers)


def _forget(program: ProfileProgram, hosts: tuple[str, ...]) -> None:
    with program.lock:
        if program.hosts == hosts:
            program.hosts = ()
