"""``pw.trace(path)`` and ``PATHWAYS_TRACE``: record a session's runs into a timeline file.

While a recording is open, the session marks every run it submits as traced, and the
controller and the workers record the run's steps (pathways/timeline.py); the client
records its own (trace, submit, put, fetch). When the recording closes, the client waits
(bounded) for the traced runs' results, collects the spans of this session from the
controller and from every worker that ran a traced run, aligns their clocks to its own
(the exchange with the shortest round trip of a few), and writes Chrome trace-event JSON.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

from pathways import config, errors
from pathways.protocol import messages as m
from pathways.protocol import operator
from pathways.timeline import MAX_EVENTS, Clock, Process, chrome_trace, now
from pathways.wire import rpc

if TYPE_CHECKING:
    from pathways.client.session import Session

log = logging.getLogger("pathways.client")

_PINGS = 3  # clock exchanges per process; the shortest round trip wins
_REQUEST_SECONDS = 30.0  # one collect request (a worker may first wait a moment for its runs to finish)
_RESULTS_SECONDS = 60.0  # how long closing waits, in all, for traced runs' results
_SETTLE_SECONDS = 2.0  # how long closing waits, at most, for the controller to record its traced runs' ends
_SETTLE_POLL_SECONDS = 0.01
_MAX_WATCHED = 4096  # outputs of traced runs waited for on close (the newest)


class Recording:
    """One open recording of a session: the spans collected while it was open."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.processes: dict[str, Process] = {}

    def add(self, processes: list[Process]) -> None:
        for p in processes:
            mine = self.processes.get(p.label)
            if mine is None:
                self.processes[p.label] = mine = p
            else:
                mine.events.extend(p.events)
                mine.dropped = max(mine.dropped, p.dropped)
                if (p.clock.error or 0) > (mine.clock.error or 0):
                    mine.clock = p.clock  # report the worse bound
            excess = len(mine.events) - MAX_EVENTS
            if excess > 0:  # a server recording every session for days keeps the newest, as a process does
                mine.events.sort(key=lambda e: e[2])
                del mine.events[:excess]
                mine.dropped += excess

    def write(self) -> None:
        """Write the timeline file (atomically: a reader never sees half of it)."""
        trace = chrome_trace(sorted(self.processes.values(), key=_order))
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, self.path)


def _order(p: Process) -> tuple:
    return (p.label.split()[0] != "client", p.label.split()[0] != "controller", p.label)


class Recordings:
    """A session's open recordings (a ``pw.trace`` block, ``PATHWAYS_TRACE``, or both), and
    the outputs of its traced runs that closing one waits for."""

    def __init__(self, session: "Session") -> None:
        self._session = weakref.proxy(session)
        self.open: list[Recording] = []
        self.outputs: deque = deque(maxlen=_MAX_WATCHED)  # (weakref to a _Buffer)

    def start(self, recording: Recording) -> None:
        self.open.append(recording)
        self._session.traced = True

    def watch(self, outputs: list) -> None:
        """Outputs (pw.Arrays) of a traced run: closing a recording waits for them."""
        for a in outputs:
            self.outputs.append(weakref.ref(a._buffer))

    def stop(self, recording: Recording) -> None:
        """Collect what the processes recorded, hand it to every open recording, write this
        one's file and close it."""
        session = self._session
        try:
            self._wait_for_results()
            processes = collect(session)
            for r in self.open:
                r.add(processes)
        finally:
            self.open.remove(recording)
            session.traced = bool(self.open)
        recording.write()

    def _wait_for_results(self) -> None:
        deadline = time.monotonic() + _RESULTS_SECONDS
        while self.outputs:
            buffer = self.outputs.popleft()()
            left = deadline - time.monotonic()
            if buffer is None or buffer.deleted or left <= 0:
                continue
            try:
                buffer.session._fetch(lambda: buffer.addresses, buffer.handle, left, data=False)  # not a step to record
            except errors.PathwaysError:  # a failed run still has its steps to show
                pass


def collect(session: "Session") -> list[Process]:
    """Take this session's spans from its own process, the controller, and every worker
    the controller names as having run its traced runs, each on this process's clock."""
    pid = os.getpid()
    processes = [Process(f"{session.timeline_label} (pid {pid})", pid, session.recorder.take_local())]
    clock = Clock()
    first = None
    for _ in range(_PINGS):
        sent = now()
        first = session.request(lambda req: m.CollectTimeline(req, 0), _REQUEST_SECONDS)
        clock.sample(sent, first.clock, now())
    names = _worker_names(session) if first.workers else {}
    for address in first.workers:
        try:
            processes.append(_worker(session, address, names.get(address, f"worker at {address}")))
        except errors.PathwaysError as e:  # one lost worker must not cost the rest of the timeline
            log.warning("no timeline from the worker at %s: %s", address, e)
    events: list = []
    settled = time.monotonic() + _SETTLE_SECONDS
    while True:
        sent = now()
        reply = session.request(lambda req: m.CollectTimeline(req, MAX_EVENTS), _REQUEST_SECONDS)
        clock.sample(sent, reply.clock, now())
        events.extend(reply.events)
        # the controller records a run's last step when its workers' done reports arrive,
        # which may be after this request: taken by the next recording, it would show
        # there a run that recording never traced
        if not reply.unfinished or time.monotonic() >= settled:
            break
        time.sleep(_SETTLE_POLL_SECONDS)
    processes.insert(1, Process(f"controller (pid {reply.pid})", reply.pid, events, clock, reply.dropped))
    return processes


def _worker_names(session: "Session") -> dict[str, str]:
    """Each worker's row label by its gRPC address: its id, island and host rank, which is
    how the cluster's status and errors name it (an address says little on a timeline)."""
    try:
        workers = session.cluster()["workers"]
    except errors.PathwaysError as e:  # the rows then keep the addresses
        log.warning("no cluster status to name the timeline's workers by: %s", e)
        return {}
    return {w["address"]: f"worker {w['worker']}, island {w['island']} host {w['rank']}" for w in workers}


def _worker(session: "Session", address: str, name: str) -> Process:
    stubs = session._stubs(address)
    ask = rpc.method(stubs.channel, rpc.WORKER_SERVICE, "Timeline", "unary_unary")
    clock = Clock()
    reply = None
    for max_events in (*[0] * _PINGS, MAX_EVENTS):
        request = m.pack(m.TimelineFetch(session.id, stubs.credential, max_events).encode())
        sent = now()
        try:
            raw = ask(request, timeout=_REQUEST_SECONDS)
        except Exception as e:  # grpc.RpcError: unreachable, or past the deadline
            raise errors.ConnectError(f"the worker's Timeline call failed: {e}") from None
        received = now()
        reply = operator.answer(operator.TIMELINE_REPLY, raw, errors.RemoteError)
        clock.sample(sent, reply.clock, received)
    return Process(f"{name} (pid {reply.pid})", reply.pid, list(reply.events), clock, reply.dropped)


class RecordingBlock:
    """A context manager recording a session's runs into ``path`` (``Session.trace``)."""

    def __init__(self, recordings: Recordings, path: str) -> None:
        self._recordings = recordings
        self._recording = Recording(path)

    def __enter__(self) -> "RecordingBlock":
        self._recordings.start(self._recording)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recordings.stop(self._recording)


_process_recording: Optional[Recording] = None
_process_lock = threading.Lock()


def process_recording() -> Optional[Recording]:
    """The recording of this whole process that ``PATHWAYS_TRACE=path`` asks for (None
    without it): every session of the process records into it, and writes the file again
    as each closes."""
    global _process_recording
    path = config.TRACE.get()
    if not path:
        return None
    with _process_lock:
        if _process_recording is None:
            _process_recording = Recording(path)
        return _process_recording
