"""The executor: runs the op streams the controller lowered (controller/lowering.py).

One thread runs every program in the order the controller sent them, which is the island's
gang order. Values live in a per-run register file; only inputs, outputs and transfers go
through the object store. A failed op poisons the registers it would have written, and
poison flows through everything downstream to whoever reads the result. A second thread
waits for each run's results in order and reports the run done with the device time it
took, which frees its slot in the controller's window and feeds the fair-share policy.
While the executor has more work queued, reports are held back briefly (up to
``REPORT_BATCH`` runs or ``REPORT_HOLD_SECONDS``) and go out together: a burst of small
runs then costs the controller a message per few runs, not one per run.
Runs of sequentially dispatched programs wait at each node's gate until the controller
releases it, and report each node finished (the ``await`` and ``step`` ops).

A run takes the lean loop once every executable of its program has compiled: the ops are
resolved then, once per program, to direct calls of the executables on register indices,
so a computation costs the executor no future, lock or generator. Until then, and from the
first poisoned register of a run on, the run takes the careful loop, which waits for
compiles and carries poison downstream. A traced run (``pw.trace``) takes the careful loop
too: its probes record each step on the timeline, and the lean loop stays free of them.

``collectives_in_flight`` bounds how many multi-device computations the executor leaves
running while it launches the next (0: no bound; see ``collectives_bound``): XLA's CPU runtime
deadlocks once a few dozen computations with collectives between one process's devices are
queued, so a CPU host with several devices waits for the oldest before launching past it.

``unsafe_local_order`` is a debugging switch that removes the gang order: the worker then
interleaves the runs of different client sessions in an order of its own (random), as a
runtime without a central sequencer would. Collectives spanning hosts then meet their
peers in different orders on different hosts, and hang or mix up their data.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections import deque
from typing import Any, Callable, Iterator, Protocol, Union

import jax
import numpy as np

from pathways.errors import WireError
from pathways.protocol.errors import LOST
from pathways.protocol.handles import session_of, value_handle
from pathways.protocol.messages import MAX_SMALL_VALUES, SMALL_VALUE_BYTES, Define, Delete, DropSession, RunProgram
from pathways.protocol.ops import Op
from pathways.threads import Threads
from pathways.timeline import RECORDER, now
from pathways.worker.executables import Executables
from pathways.worker.shared_arrays import shareable
from pathways.worker.store import ObjectStore, Poison, collective_failure, failure
from pathways.worker.xla import XlaExecutable

log = logging.getLogger("pathways.worker")

# The loop compares op codes by identity with these (decode_op returns Op members).
_IN, _EXEC, _OUT, _SEND, _RESHARD, _DROP, _AWAIT, _STEP = (Op.IN, Op.EXEC, Op.OUT, Op.SEND, Op.RESHARD, Op.DROP,
                                                          Op.AWAIT, Op.STEP)

# The lean loop's resolved exec ops (not wire ops): a call with one input and one output, and
# any other call: (_CALL1, executable, in, out, name) and (_CALL, executable or its _launcher when held, ins, outs,
# name, held).
_CALL1, _CALL = object(), object()

# What the executor runs in order: runs, deletes, and the forgetting of a closed session's
# programs and functions (in order, so that every host of an island runs the runs queued
# before it and their collectives meet).
Work = Union[RunProgram, Delete, DropSession]

REPORT_BATCH = 8  # done reports held back at most while more work is queued
REPORT_HOLD_SECONDS = 0.002  # how long the first of them may wait for the others

# Multi-device computations left running on a CPU host of several devices. XLA's CPU runtime
# runs each device's share on a shared thread pool, and a share waiting in a collective for
# its peers holds its thread: with a few dozen computations queued (32 back to back on 2, 4 or
# 8 devices of a 2-core host), every thread waits in one and the shares they wait for never
# start; XLA aborts the process 40 s later. 16 never hung there; 8 keeps a margin and cost
# no throughput measured.
CPU_COLLECTIVES_IN_FLIGHT = 8


def collectives_bound(kind: str, devices: int, hosts: int) -> int:
    """How many multi-device computations a worker with ``devices`` devices of ``kind``, on
    an island of ``hosts`` hosts, leaves running while it launches the next (0: no bound).
    Under jax.distributed a CPU host with several devices hangs even sooner (after a few
    dozen computations spanning hosts), so there each waits for the one before."""
    if kind != "cpu" or devices < 2:
        return 0
    return 1 if hosts > 1 else CPU_COLLECTIVES_IN_FLIGHT


class Controls(Protocol):
    """What the executor asks of its host: push arrays to peers, and talk to the controller."""

    def send(self, handle: int, value: Any, layout: list, routes: tuple, run: int = 0) -> None: ...

    def done(self, reports: list[tuple[int, float]], failed: list[int],
             values: list[tuple[int, int, bytes]]) -> None: ...

    def released(self, run: int, node: int, timeout: float) -> bool: ...

    def step(self, run: int, node: int) -> None: ...

    def session_dropped(self, session: int, functions: int) -> None: ...

    def broken(self, run: int, message: str) -> None: ...


class Executor:
    def __init__(self, store: ObjectStore, executables: Executables, controls: Controls,
                 wait_timeout: float, collectives_in_flight: int = 0, unsafe_local_order: bool = False) -> None:
        self._store = store
        self._executables = executables
        self._controls = controls
        self._wait_timeout = wait_timeout
        self._collectives_in_flight = collectives_in_flight
        self._running: deque = deque()  # what stands for each multi-device computation maybe still running
        self._unsafe_local_order = unsafe_local_order
        self._programs: dict[int, _Program] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._traced: dict[int, tuple[int, int]] = {}  # traced run id -> (its base, when its ops ended)
        self._failing: set[int] = set()  # runs that stored a failed output, until reported done
        # runs sent with notify -> (handle, array) of their small outputs, until reported done
        self._told: dict[int, list[tuple[int, Any]]] = {}
        self._reported = 0  # when the reporter last recorded a traced run done
        self.worker_id = -1
        self._threads = Threads("the worker's executor")
        self._threads.start(self._loop, "pathways-executor")
        self._threads.start(self._report_loop, "pathways-done")

    @property
    def programs(self) -> int:
        return len(self._programs)

    def submit(self, msg: Work) -> None:
        self._queue.put(msg)

    def stop(self) -> None:
        self._queue.put(None)
        self._finished.put(None)
        self._threads.join()

    def define(self, msg: Define) -> None:
        """Prepare a decoded op stream (ops.decode_op checked it): resolve each function to
        its executable and each layout to what the loop uses. Raises WireError for a
        function or device this worker does not have."""
        # each transfer copy a run takes, by its number from the run's tbase, and the peers it comes from
        copies = tuple((op[1] - msg.nvalues, frozenset(op[2]) - {self.worker_id})
                       for op in msg.ops if op[0] is _IN and op[2])
        self._programs[msg.key] = _Program([self._prepare(op) for op in msg.ops], msg.nvalues,
                                           msg.nvalues + msg.ncopies, copies)

    def copies_from_peers(self, key: int) -> tuple[tuple[int, frozenset[int]], ...]:
        """The transfer copies a run of program ``key`` takes: (its number from the run's
        tbase, the peers that push it here), none for a program never defined here."""
        program = self._programs.get(key)
        return program.copies if program is not None else ()

    def _prepare(self, op: tuple) -> tuple:
        code = op[0]
        if code is _EXEC:
            _, key, ins, outs = op
            fn = self._executables.get(key)
            if fn is None:
                raise WireError(f"exec names function {key:#x}, which was never compiled on this worker")
            return (_EXEC, fn[0], fn[1], ins, outs, self._executables.multi_device(key), key)
        if code is _SEND:  # the put header carries the layout in its wire form
            _, v, dst, layout, routes = op
            return (_SEND, v, dst, layout.to_wire(), routes)
        if code is _RESHARD:
            _, v, dst, layout = op
            return (_RESHARD, v, dst, self._executables.sharding(layout))
        if code is _IN:  # whether it is taken out of the store: a transfer copy (it has senders)
            _, v, senders = op
            return (_IN, v, bool(senders))
        return op

    def _loop(self) -> None:
        for msg in self._messages():
            try:
                kind = type(msg)
                if kind is RunProgram:
                    self._run(msg)
                elif kind is Delete:
                    self._store.delete(msg.handles)
                else:
                    self._drop_session(msg)
            except Exception:  # a bug must not kill the executor; the message is dropped
                log.exception("executor dropped message %r", msg.TAG)

    def _drop_session(self, msg: DropSession) -> None:
        for key in msg.programs:
            self._programs.pop(key, None)
        self._controls.session_dropped(msg.session, self._executables.drop_session(msg.session))

    def _messages(self) -> Iterator[Work]:
        """Messages in arrival order (the gang order), or, with the unsafe switch, each
        session's messages in order but sessions interleaved at random."""
        if not self._unsafe_local_order:
            while (msg := self._queue.get()) is not None:
                yield msg
            return
        pending: dict[int, deque] = {}
        rng = random.Random()
        while True:
            block = not pending
            try:
                while True:
                    msg = self._queue.get(block=block)
                    if msg is None:
                        return
                    pending.setdefault(_session_of_message(msg), deque()).append(msg)
                    block = False
            except queue.Empty:
                pass
            sid = rng.choice(list(pending))
            yield pending[sid].popleft()
            if not pending[sid]:
                del pending[sid]

    def _report_loop(self) -> None:
        """Wait for each run's results, in order, and report the device time each took.
        Runs finished while the thread was busy are reported together, in one message;
        while the executor has more work queued, reports wait a little for the next ones."""
        busy_until = 0.0
        reports: list[tuple[int, float]] = []
        held_since = 0.0
        while True:
            if reports:
                left = held_since + REPORT_HOLD_SECONDS - time.perf_counter()
                try:
                    item = self._finished.get(timeout=left) if left > 0 else self._finished.get_nowait()
                except queue.Empty:
                    item = ()
            else:
                item = self._finished.get()
            if item is None:
                break
            if item:
                run_id, started, results = item
                try:
                    jax.block_until_ready(results)
                except Exception as e:  # the failure reaches readers through the results themselves
                    self._failing.add(run_id)
                    if collective_failure(e):
                        self._failed(f"run {run_id}", e, run_id)
                finished = time.perf_counter()
                if not reports:
                    held_since = finished
                reports.append((run_id, finished - max(started, busy_until)))
                busy_until = finished
                if finished < held_since + REPORT_HOLD_SECONDS and (
                        not self._finished.empty() or (len(reports) < REPORT_BATCH and not self._queue.empty())):
                    continue  # more runs finished, or follow at once: report them together
            self._report(reports)
            reports = []
        if reports:
            self._report(reports)

    def _report(self, reports: list[tuple[int, float]]) -> None:
        failing, told = self._failing, self._told
        values = []
        if told:
            for run_id, _ in reports:
                for handle, value in told.pop(run_id, ()):
                    if run_id in failing or len(values) >= MAX_SMALL_VALUES:
                        continue
                    try:
                        raw = _whole_bytes(value)
                    except Exception:  # its computation failed after all: readers ask for it, and learn why
                        failing.add(run_id)
                        continue
                    if raw is not None:
                        values.append((run_id, handle, raw))
        self._controls.done(reports, [r for r, _ in reports if r in failing] if failing else [], values)
        if failing:
            for run_id, _ in reports:
                failing.discard(run_id)
        if self._traced:
            for run_id, _ in reports:
                self._traced_done(run_id)

    def _keep_peers_company(self, future: Any, key: int) -> None:
        """Run a multi-host function on zeros when this host's inputs are poisoned: the other
        hosts run it with theirs and would wait in its collectives forever."""
        try:
            executable = future.result(timeout=self._wait_timeout)
            placeholders = self._executables.placeholders(key, executable)
            if placeholders is not None:
                jax.block_until_ready(executable(*placeholders))
        except Exception:  # the outputs are poisoned either way
            log.exception("running a multi-host function on placeholders failed")

    def _traced_done(self, run_id: int) -> None:
        traced = self._traced.pop(run_id, None)
        if traced is not None:
            RECORDER.span("done", max(traced[1], self._reported), traced[0], "results ready, run reported done")
            self._reported = now()
            RECORDER.closed(traced[0])

    def _run(self, msg: RunProgram) -> None:
        traced = msg.traced
        if traced:
            RECORDER.opened(msg.base)
        program = self._programs.get(msg.key)
        if program is None:
            log.error("run names program %r, which was never defined here", msg.key)
            self._failing.add(msg.id)  # its outputs never come
            if traced:
                self._traced[msg.id] = (msg.base, now())
            self._finished.put((msg.id, time.perf_counter(), []))  # free its window slot
            return
        if program.lean is None:
            program.lean = _resolve(program.ops, self._collectives_in_flight > 0)
        regs: list[Any] = [None] * program.nregs
        # started: when the first computation starts (waits for compiles and inputs are not
        # device time); last: the latest computation's results (ready: the run's work is done).
        i, started, last = 0, 0.0, ()
        if program.lean is not None and not traced:  # a traced run takes the careful loop, which has the probes
            i, started, last = self._run_lean(program.lean, regs, msg, program.nvalues)
        if i < len(program.ops):
            started, last = self._run_careful(program.ops, i, regs, msg, program.nvalues, started, last)
        if traced:
            self._traced[msg.id] = (msg.base, now())
        self._finished.put((msg.id, started or time.perf_counter(), last))

    def _run_lean(self, ops: list[tuple], regs: list, msg: RunProgram, nvalues: int) -> tuple[int, float, Any]:
        """Run ``ops`` (resolved) until the first poisoned register: the index of the op after
        the one that poisoned it (``len(ops)`` when none did), started and last (see _run)."""
        started = 0.0
        last: Any = ()
        effect = self._effect
        i = 0
        for op in ops:
            i += 1
            code = op[0]
            if code is _CALL1:
                if not started:
                    started = time.perf_counter()
                try:
                    last = op[1](regs[op[2]])
                except Exception as e:
                    regs[op[3]] = self._failed(op[4], e, msg.id)
                    return i, started, last
                regs[op[3]] = last[0]
            elif code is _CALL:
                _, executable, ins, outs, name, held = op
                if not started:
                    started = time.perf_counter()
                try:
                    if held:  # executable is a _launcher
                        results, done = executable(*[regs[r] for r in ins])
                        self._hold_back(done)
                    else:
                        results = executable(*[regs[r] for r in ins])
                except Exception as e:
                    bad = self._failed(name, e, msg.id)
                    for o in outs:
                        regs[o] = bad
                    return i, started, last
                for o, r in zip(outs, results):
                    regs[o] = r
                last = results
            else:
                effect(op, regs, msg, nvalues)
                if (code is _IN and type(regs[op[1]]) is Poison) or (code is _RESHARD and type(regs[op[2]]) is Poison):
                    return i, started, last
        return i, started, last

    def _run_careful(self, ops: list[tuple], i: int, regs: list, msg: RunProgram, nvalues: int, started: float,
                     last: Any) -> tuple[float, Any]:
        """Run ``ops[i:]`` (as prepared at define), waiting for executables still compiling and
        passing poisoned inputs on to outputs; started and last (see _run). A traced run
        records its steps on the timeline here."""
        traced = msg.traced
        for op in ops[i:]:
            if op[0] is not _EXEC:
                self._effect(op, regs, msg, nvalues)
                continue
            _, future, name, ins, outs, multi_device, key = op
            inputs = [regs[r] for r in ins]
            bad = next((a for a in inputs if type(a) is Poison), None)
            if bad is not None:
                self._keep_peers_company(future, key)
            else:
                try:
                    executable = future.result(timeout=self._wait_timeout)
                    started = started or time.perf_counter()
                    if traced:
                        began = now()
                    if multi_device and self._collectives_in_flight:
                        results, done = _launcher(executable)(*inputs)
                        self._hold_back(done)
                    else:
                        results = executable(*inputs)
                    if traced:
                        RECORDER.span("execute", began, msg.base,
                                      executable.label if type(executable) is XlaExecutable else name)
                except Exception as e:
                    bad = self._failed(name, e, msg.id)
                else:
                    for o, r in zip(outs, results):
                        regs[o] = r
                    last = results
                    continue
            for o in outs:
                regs[o] = bad
        return started, last

    def _failed(self, what: str, error: Exception, run: int) -> Poison:
        """The poison for ``what`` of run ``run`` having failed with ``error``; a failed
        collective also tells the controller that the island's group is broken."""
        bad = failure(f"{what} on worker {self.worker_id}", error)
        if bad.kind == LOST:
            self._controls.broken(run, bad.message)
        return bad

    def _producer(self, msg: RunProgram, register: int) -> str:
        """The name of the function of ``msg``'s program that writes ``register``."""
        program = self._programs.get(msg.key)
        for op in reversed(program.ops if program is not None else ()):
            if op[0] is _EXEC and register in op[4]:
                return op[2]
        return "the program"

    def _hold_back(self, done: Any) -> None:
        """After launching a multi-device computation (``done``: what stands for it, see
        ``_launcher``): wait until fewer than ``collectives_in_flight`` are running. Outputs
        found ready are let go at once, so that no array is kept past its use."""
        running = self._running
        while running and _finished(running[0]):
            running.popleft()
        if done is not None:
            running.append(done)
        while len(running) >= self._collectives_in_flight:
            try:
                running.popleft().block_until_ready()
            except Exception:  # the failure reaches readers through the outputs themselves
                pass

    def _effect(self, op: tuple, regs: list, msg: RunProgram, nvalues: int) -> None:
        """Run ``op``, any op but an exec."""
        code = op[0]
        traced = msg.traced
        if code is _IN:
            h = value_handle(op[1], msg.base, msg.tbase, nvalues, msg.args)
            if traced:
                began = now()
            value = self._store.wait(h, self._wait_timeout, take=op[2])
            if traced:
                RECORDER.span("wait for inputs", began, msg.base, f"array {h:#x}")
            if value is None:
                value = Poison(f"array {h:#x} did not reach worker {self.worker_id} within "
                               f"{self._wait_timeout:.0f} s: it was deleted, or its sender failed")
            regs[op[1]] = value
        elif code is _OUT:
            # not made shareable here: most outputs are only run again, and whoever reads one,
            # in any thread, makes it shareable first (shared_arrays.py)
            # past the session's quota, the refusal says which function made it (looked up then)
            value = regs[op[1]]
            handle = value_handle(op[1], msg.base, msg.tbase, nvalues, msg.args)
            if self._store.put_output(handle, value, lambda: f"the output of {self._producer(msg, op[1])} on "
                                                             f"worker {self.worker_id},"):
                self._failing.add(msg.id)
            elif msg.notify and getattr(value, "nbytes", SMALL_VALUE_BYTES + 1) <= SMALL_VALUE_BYTES:
                self._told.setdefault(msg.id, []).append((handle, value))  # its bytes go with the run's Done
        elif code is _DROP:
            for v in op[1]:
                regs[v] = None
        elif code is _SEND:
            self._controls.send(value_handle(op[2], msg.base, msg.tbase, nvalues, msg.args), regs[op[1]],
                                op[3], op[4], msg.base if traced else 0)
        elif code is _AWAIT:
            if traced:
                began = now()
            if not self._controls.released(msg.id, op[1], self._wait_timeout):
                log.error("run %d: node %d was not released within %.0f s; running it anyway",
                          msg.id, op[1], self._wait_timeout)
            if traced:
                RECORDER.span("wait for release", began, msg.base, f"node {op[1]}")
        elif code is _STEP:
            try:
                jax.block_until_ready([regs[v] for v in op[2] if type(regs[v]) is not Poison])
            except Exception:  # the failure reaches readers through the outputs themselves
                pass
            self._controls.step(msg.id, op[1])
        else:  # _RESHARD
            value = regs[op[1]]
            if type(value) is not Poison:
                try:
                    value = jax.device_put(shareable(value), op[3])
                except Exception as e:
                    value = Poison(f"moving an array on worker {self.worker_id} failed: {e}")
            regs[op[2]] = value


class _Program:
    """A defined op stream: ``ops`` as prepared at define (executables still futures),
    ``lean``, the same with every executable resolved (None until all have compiled), and
    ``copies``, what ``Executor.copies_from_peers`` gives."""

    __slots__ = ("ops", "nvalues", "nregs", "lean", "copies")

    def __init__(self, ops: list[tuple], nvalues: int, nregs: int,
                 copies: tuple[tuple[int, frozenset[int]], ...]) -> None:
        self.ops, self.nvalues, self.nregs, self.copies = ops, nvalues, nregs, copies
        self.lean: list[tuple] | None = None


def _launcher(executable: Any) -> Callable[..., tuple[list, Any]]:
    """``executable`` as a call that returns its outputs and what stands for its run in
    ``Executor._hold_back``: XLA's token of the run for an "xla" function (a later run may
    take its outputs as donations, which deletes them), else its first output (a function
    compiled from a jax.export artifact donates nothing)."""
    if type(executable) is XlaExecutable:
        return executable.launch

    def launch(*args: Any) -> tuple[list, Any]:
        results = executable(*args)
        return results, (results[0] if results else None)
    return launch


def _whole_bytes(value: Any) -> bytes | None:
    """A small output's bytes in C order, where one buffer of this host holds all of it: on
    one device, or replicated on every device. Not for a jax.Array spanning hosts, one
    deleted since (e.g. donated to a later run), nor one split over devices: its blocks are
    assembled where it is read, from each device's buffer (here the array's device order may
    not be the executable's: a transposed tile assignment). Raises the error its computation
    failed with."""
    if (not isinstance(value, jax.Array) or not value.is_fully_addressable or value.is_deleted()
            or not (value.is_fully_replicated or len(value.sharding.device_set) == 1)):
        return None
    return np.ascontiguousarray(np.asarray(shareable(value))).tobytes()


def _finished(done: Any) -> bool:
    """Whether the run ``done`` stands for is known to be over without waiting (a token
    cannot say; waiting on one whose run is over returns at once)."""
    return isinstance(done, jax.Array) and (done.is_deleted() or done.is_ready())


def _resolve(ops: list[tuple], bounded: bool) -> list[tuple] | None:
    """``ops`` for the lean loop, every exec a direct call of its compiled executable; None
    while any is still compiling, or if one failed (the careful loop then reports it).
    ``bounded``: multi-device calls are ``_launcher``s, held back by ``Executor._hold_back``."""
    lean = []
    for op in ops:
        if op[0] is not _EXEC:
            lean.append(op)
            continue
        _, future, name, ins, outs, multi_device, _ = op
        if not future.done() or future.cancelled() or future.exception() is not None:
            return None
        executable = future.result()
        held = multi_device and bounded
        if len(ins) == 1 and len(outs) == 1 and not held:
            lean.append((_CALL1, executable, ins[0], outs[0], name))
        else:
            lean.append((_CALL, _launcher(executable) if held else executable, ins, outs, name, held))
    return lean


def _session_of_message(msg: Work) -> int:
    if type(msg) is RunProgram:
        return session_of(msg.base)
    if type(msg) is Delete:
        return session_of(msg.handles[0]) if msg.handles else 0
    return msg.session
