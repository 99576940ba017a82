"""The timeline recorder: spans of the steps of traced runs, in one process.

Every process (client, controller, worker) has one ``RECORDER``. A probe on a run's path
records a span only for a traced run (the ``traced`` flag of ``Run``/``RunProgram``, or a
client session inside ``pw.trace``), so untraced runs pay one attribute test per probe
and nothing is switched on globally. A span is ``(name, thread, start_ns, dur_ns, run,
detail)``: ``run`` is the run's handle base (the client chose it; its session is in the
high bits), or 0 for a step that belongs to no one run (a program's trace), and times
are this process's ``time.perf_counter_ns``. A client collects the spans of its session
from each process (``take``) together with that process's clock, and aligns them
(``align``). The buffer is bounded; when full, the oldest spans go first and are counted.

Nothing here does I/O.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from threading import get_ident
from typing import Optional

from pathways.protocol.handles import session_of
from pathways.protocol.messages import MAX_DETAIL, MAX_EVENTS
from pathways.protocol.messages import MAX_SPAN_NAME as MAX_NAME

now = time.perf_counter_ns

Event = tuple  # (name, thread, start_ns, dur_ns, run, detail)
_MAX_THREADS = 4096  # thread names remembered (a thread's ident may be reused by a later one)
# Steps that are waits, which overlap each other on their row (runs queued together):
# written as async slices, which trace viewers stack instead of nesting.
WAITS = frozenset({"queue"})


class Recorder:
    """Spans of traced runs, thread-safe (a deque's append is atomic)."""

    def __init__(self, limit: int = MAX_EVENTS) -> None:
        self._events: deque[Event] = deque(maxlen=limit)
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}  # run base -> traced runs of it not yet finished here
        self._idle = threading.Condition(self._lock)
        self.dropped = 0  # spans pushed out of a full buffer
        self._threads: dict[int, str] = {}  # thread ident -> its name, cut to MAX_NAME

    def span(self, name: str, start: int, run: int = 0, detail: str = "", thread: Optional[str] = None) -> None:
        """Record a step that began at ``start`` (``now()``) and ends now, on this thread
        (or on the row ``thread``: for waits that overlap other steps)."""
        end = now()
        if thread is None:
            ident = get_ident()
            thread = self._threads.get(ident) or self._thread_name(ident)
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append((name, thread, start, end - start, run, detail))

    def _thread_name(self, ident: int) -> str:
        name = threading.current_thread().name[:MAX_NAME]
        if len(self._threads) < _MAX_THREADS:
            self._threads[ident] = name
        return name

    def opened(self, run: int) -> None:
        """A traced run started here; ``closed`` once its last step is recorded."""
        with self._lock:
            self._open[run] = self._open.get(run, 0) + 1

    def closed(self, run: int) -> None:
        with self._lock:
            left = self._open.get(run, 0) - 1
            if left > 0:
                self._open[run] = left
            else:
                self._open.pop(run, None)
                self._idle.notify_all()

    def take(self, session: int, limit: int, settle: float = 0.0) -> tuple[list[Event], int]:
        """Remove and return up to ``limit`` spans of ``session``'s runs (oldest first),
        and how many spans this process dropped so far. First waits up to ``settle``
        seconds for the session's runs still open here to finish (their last step, the
        done report, follows their results by moments)."""
        with self._idle:
            self._idle.wait_for(lambda: not any(session_of(r) == session for r in self._open), settle)
            mine, rest = [], []
            # spans keep arriving meanwhile (``span`` takes no lock): pop what is there now
            for _ in range(len(self._events)):
                try:
                    event = self._events.popleft()
                except IndexError:  # a full buffer pushed it out under us
                    break
                run = event[4]
                if run and session_of(run) == session and len(mine) < limit:
                    mine.append(event[:5] + (event[5][:MAX_DETAIL],))  # cut here, not on the run's path
                else:
                    rest.append(event)
            self._events.extend(rest)
            return mine, self.dropped

    def take_local(self) -> list[Event]:
        """Remove and return every span (a client's own process: all of them are its own)."""
        out = []
        for _ in range(len(self._events)):
            try:
                out.append(self._events.popleft())
            except IndexError:
                break
        return out


RECORDER = Recorder()


def span(name: str, start: int, run: int = 0, detail: str = "", thread: Optional[str] = None) -> None:
    RECORDER.span(name, start, run, detail, thread)


# How JAX names the module it compiles for ``jax.jit(f)`` ("jit_f") and ``jax.pmap(f)``.
_MODULE_PREFIXES = ("jit_", "pmap_")


def function_label(module: str) -> str:
    """The name a reader knows a compiled module's function by: ``train_step`` for the
    module ``jit_train_step``; any other name as it is."""
    for prefix in _MODULE_PREFIXES:
        if module.startswith(prefix) and len(module) > len(prefix):
            return module[len(prefix):]
    return module


class Clock:
    """Where a process's clock stands against this one's: NTP-style, from a request sent
    at ``sent`` and answered at ``received`` (both here), stamped ``remote`` there. The
    exchange with the shortest round trip wins; its half round trip bounds the error."""

    def __init__(self) -> None:
        self.offset = 0  # remote - local, ns
        self.error: Optional[int] = None  # ns; None until a sample

    def sample(self, sent: int, remote: int, received: int) -> None:
        error = (received - sent) // 2
        if self.error is None or error < self.error:
            self.error = error
            self.offset = remote - (sent + received) // 2

    def local(self, remote_ns: int) -> int:
        return remote_ns - self.offset


class Process:
    """One process's spans for a timeline file, on the collecting client's clock."""

    def __init__(self, label: str, pid: int, events: list[Event], clock: Optional[Clock] = None,
                 dropped: int = 0) -> None:
        self.label = label
        self.pid = pid
        self.clock = clock or Clock()
        self.events = [(n, t, self.clock.local(s), d, r, x) for n, t, s, d, r, x in events]
        self.dropped = dropped

    @property
    def error_us(self) -> float:
        return (self.clock.error or 0) / 1000


def chrome_trace(processes: list[Process]) -> dict:
    """Chrome trace-event JSON (what Perfetto and chrome://tracing open): a complete ("X")
    event per span in microseconds, names for processes and threads, and flow arrows from
    each run's submission on the client through the controller's dispatch to its arrival
    on each worker. ``otherData`` has each process's clock error bound and lost spans."""
    starts = [e[2] for p in processes for e in p.events]
    origin = min(starts) if starts else 0
    out: list[dict] = []
    waits = 0
    tids: dict[tuple[int, str], int] = {}
    firsts: dict[tuple[int, int, str], tuple[int, int, float]] = {}  # (run, pid, name) -> (pid, tid, ts) of its first
    for index, p in enumerate(processes):
        pid = index + 1  # real pids may repeat across machines
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p.label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": index}})
        for name, thread, start, dur, run, detail in sorted(p.events, key=lambda e: e[2]):
            tid = tids.get((pid, thread))
            if tid is None:
                tid = tids[(pid, thread)] = len(tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
            ts = (start - origin) / 1000
            args = {"detail": detail} if detail else {}
            if run:
                args["run"] = f"{run:#x}"
            cat = p.label.split()[0]
            if name in WAITS:
                waits += 1
                out.append({"ph": "b", "id": waits, "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                            "args": args})
                out.append({"ph": "e", "id": waits, "name": name, "cat": cat, "pid": pid, "tid": tid,
                            "ts": ts + dur / 1000})
                continue
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur / 1000,
                        "args": args})
            firsts.setdefault((run, pid, name), (pid, tid, ts + dur / 2000))
    out.extend(_flows(firsts, len(processes)))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"clock_error_us": {p.label: p.error_us for p in processes},
                          "dropped": {p.label: p.dropped for p in processes if p.dropped}}}


def _flows(firsts: dict, nprocesses: int) -> list[dict]:
    """A flow per run and worker: client submit -> controller dispatch -> worker receive."""
    out: list[dict] = []
    flow = 0
    dispatches = {run: v for (run, _, name), v in firsts.items() if name == "dispatch"}
    for (run, pid, name), (_, tid, ts) in firsts.items():
        if name != "submit" or not run:
            continue
        dispatch = dispatches.get(run)
        for other in range(1, nprocesses + 1):
            arrival = firsts.get((run, other, "receive"))
            if arrival is None:
                continue
            flow += 1
            out.append({"ph": "s", "id": flow, "name": "run", "cat": "run", "pid": pid, "tid": tid, "ts": ts})
            if dispatch is not None:
                out.append({"ph": "t", "id": flow, "name": "run", "cat": "run", "pid": dispatch[0],
                            "tid": dispatch[1], "ts": dispatch[2]})
            out.append({"ph": "f", "bp": "e", "id": flow, "name": "run", "cat": "run", "pid": arrival[0],
                        "tid": arrival[1], "ts": arrival[2]})
    return out
