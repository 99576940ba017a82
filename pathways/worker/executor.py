"""The executor: runs the op streams the controller lowered (controller/lowering.py).

One thread runs every program in the order the controller sent them, which is the island's
gang order. Values live in a per-run register file; only inputs, outputs and transfers go
through the object store. A failed op poisons the registers it would have written, and
poison flows through everything downstream to whoever reads the result. A second thread
waits for each run's results in order and reports the run done with the device time it
took, which frees its slot in the controller's window and feeds the fair-share policy.
Runs of sequentially dispatched programs wait at each node's gate until the controller
releases it, and report each node finished (the ``await`` and ``step`` ops).

``unsafe_local_order`` is a debugging switch that removes the gang order: the worker then
interleaves the runs of different client sessions in an order of its own (random), as a
runtime without a central sequencer would. Collectives spanning hosts then meet their
peers in different orders on different hosts, and hang or mix up their data.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from typing import Any, Iterator, Protocol

import jax

from pathways.errors import WireError
from pathways.handles import session_of
from pathways.ir import Layout
from pathways.wire.codec import int_list
from pathways.worker.executables import Executables
from pathways.worker.store import ObjectStore, Poison, failure

log = logging.getLogger("pathways.worker")

_IN, _EXEC, _OUT, _SEND, _RESHARD, _DROP, _AWAIT, _STEP = range(8)
_ARITY = {"in": 3, "exec": 4, "out": 2, "send": 5, "reshard": 4, "drop": 2, "await": 2, "step": 3}


class Controls(Protocol):
    """What the executor asks of its host: push arrays to peers, and talk to the controller."""

    def send(self, handle: int, value: Any, layout: list, routes: list) -> None: ...

    def done(self, reports: list) -> None: ...

    def released(self, run: int, node: int, timeout: float) -> bool: ...

    def step(self, run: int, node: int) -> None: ...


class Executor:
    def __init__(self, store: ObjectStore, executables: Executables, controls: Controls,
                 wait_timeout: float, sync_collectives: bool = False, unsafe_local_order: bool = False) -> None:
        self._store = store
        self._executables = executables
        self._controls = controls
        self._wait_timeout = wait_timeout
        self._sync_collectives = sync_collectives
        self._unsafe_local_order = unsafe_local_order
        self._programs: dict[int, tuple[list[tuple], int, int]] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self.worker_id = -1
        self._thread = threading.Thread(target=self._loop, name="pathways-executor", daemon=True)
        self._thread.start()
        self._reporter = threading.Thread(target=self._report_loop, name="pathways-done", daemon=True)
        self._reporter.start()

    @property
    def programs(self) -> int:
        return len(self._programs)

    def submit(self, msg: dict) -> None:
        self._queue.put(msg)

    def stop(self) -> None:
        self._queue.put(None)
        self._finished.put(None)
        self._thread.join(timeout=5)

    def define(self, msg: dict) -> None:
        """Check and prepare an op stream; raises WireError for a malformed one."""
        nvalues, ncopies = msg["nvalues"], msg["ncopies"]
        nregs = nvalues + ncopies
        prepared = [self._prepare(op, nregs) for op in msg["ops"]]
        self._programs[msg["key"]] = (prepared, nvalues, nregs)

    def _prepare(self, op: Any, nregs: int) -> tuple:
        if not isinstance(op, list) or not op or not isinstance(op[0], str):
            raise WireError(f"op {op!r} is not a list starting with its name")

        def reg(v: Any) -> int:
            if not isinstance(v, int) or not 0 <= v < nregs:
                raise WireError(f"op {op[0]!r} names register {v!r} outside 0..{nregs - 1}")
            return v

        kind, arity = op[0], _ARITY.get(op[0])
        if arity is None or len(op) != arity:
            raise WireError(f"op {op!r} is unknown or has the wrong number of fields")
        if kind == "in":
            return (_IN, reg(op[1]), bool(op[2]))
        if kind == "exec":
            fn = self._executables.get(op[1]) if isinstance(op[1], int) else None
            if fn is None:
                raise WireError(f"exec names function {op[1]!r}, which was never registered here")
            return (_EXEC, fn[0], fn[1], [reg(v) for v in int_list(op[2], "exec ins")],
                    [reg(v) for v in int_list(op[3], "exec outs")], self._executables.multi_device(op[1]), op[1])
        if kind == "out":
            return (_OUT, reg(op[1]))
        if kind == "send":
            Layout.from_wire(op[3])
            return (_SEND, reg(op[1]), reg(op[2]), op[3], _routes(op[4]))
        if kind == "reshard":
            return (_RESHARD, reg(op[1]), reg(op[2]), self._executables.sharding(Layout.from_wire(op[3])))
        if kind in ("await", "step"):
            if not isinstance(op[1], int) or op[1] < 0:
                raise WireError(f"{kind} needs a node number")
            if kind == "await":
                return (_AWAIT, op[1])
            return (_STEP, op[1], [reg(v) for v in int_list(op[2], "step outputs")])
        return (_DROP, [reg(v) for v in int_list(op[1], "drop registers")])

    def _loop(self) -> None:
        for msg in self._messages():
            try:
                kind = msg["t"]
                if kind == "run":
                    self._run(msg)
                elif kind == "delete":
                    self._store.delete(msg["handles"])
            except Exception:  # a bug must not kill the executor; the message is dropped
                log.exception("executor dropped message %r", msg.get("t"))

    def _messages(self) -> Iterator[dict]:
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
        Runs queued up while the thread was busy are reported together, in one message."""
        busy_until = 0.0
        stopping = False
        while not stopping:
            batch = [self._finished.get()]
            while True:
                try:
                    batch.append(self._finished.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stopping = True
                batch = batch[:batch.index(None)]
            reports = []
            for run_id, started, results in batch:
                try:
                    jax.block_until_ready(results)
                except Exception:  # the failure reaches readers through the results themselves
                    pass
                now = time.perf_counter()
                reports.append([run_id, now - max(started, busy_until)])
                busy_until = now
            if reports:
                self._controls.done(reports)

    def _keep_peers_company(self, future: Any, key: int) -> None:
        """Run a multi-host function on zeros when this host's inputs are poisoned: the other
        hosts run it with theirs and would wait in its collectives forever."""
        try:
            placeholders = self._executables.placeholders(key)
            if placeholders is not None:
                jax.block_until_ready(future.result(timeout=self._wait_timeout)(*placeholders))
        except Exception:  # the outputs are poisoned either way
            log.exception("running a multi-host function on placeholders failed")

    def _run(self, msg: dict) -> None:
        program = self._programs.get(msg["key"])
        if program is None:
            log.error("run names program %r, which was never defined here", msg["key"])
            self._finished.put((msg["id"], time.perf_counter(), []))  # free its window slot
            return
        ops, nvalues, nregs = program
        base, tbase, args = msg["base"], msg["tbase"], msg["args"]

        def handle(v: int) -> int:
            h = args.get(v)
            if h is None:
                h = base + v if v < nvalues else tbase + v - nvalues
            return h

        regs: list[Any] = [None] * nregs
        store = self._store
        started = 0.0  # when the first computation starts: waits for compiles and inputs are not device time
        last: Any = ()  # the latest computation's results: ready means the run's work is done
        for op in ops:
            code = op[0]
            if code == _EXEC:
                _, future, name, ins, outs, multi_device, key = op
                inputs = [regs[i] for i in ins]
                bad = next((a for a in inputs if type(a) is Poison), None)
                if bad is not None:
                    self._keep_peers_company(future, key)
                else:
                    try:
                        executable = future.result(timeout=self._wait_timeout)
                        started = started or time.perf_counter()
                        results = executable(*inputs)
                        if multi_device and self._sync_collectives:
                            jax.block_until_ready(results)
                    except Exception as e:
                        bad = failure(f"{name} on worker {self.worker_id}", e)
                    else:
                        for o, r in zip(outs, results):
                            regs[o] = r
                        last = results
                        continue
                for o in outs:
                    regs[o] = bad
            elif code == _IN:
                h = handle(op[1])
                value = store.wait(h, self._wait_timeout)
                if value is None:
                    value = Poison(f"array {h:#x} did not reach worker {self.worker_id} within "
                                   f"{self._wait_timeout:.0f} s: it was deleted, or its sender failed")
                elif not op[2]:
                    store.pop(h)
                regs[op[1]] = value
            elif code == _OUT:
                store.put(handle(op[1]), regs[op[1]])
            elif code == _DROP:
                for v in op[1]:
                    regs[v] = None
            elif code == _SEND:
                self._controls.send(handle(op[2]), regs[op[1]], op[3], op[4])
            elif code == _AWAIT:
                if not self._controls.released(msg["id"], op[1], self._wait_timeout):
                    log.error("run %d: node %d was not released within %.0f s; running it anyway",
                              msg["id"], op[1], self._wait_timeout)
            elif code == _STEP:
                try:
                    jax.block_until_ready([regs[v] for v in op[2] if type(regs[v]) is not Poison])
                except Exception:  # the failure reaches readers through the outputs themselves
                    pass
                self._controls.step(msg["id"], op[1])
            else:  # _RESHARD
                value = regs[op[1]]
                if type(value) is not Poison:
                    try:
                        value = jax.device_put(value, op[3])
                    except Exception as e:
                        value = Poison(f"moving an array on worker {self.worker_id} failed: {e}")
                regs[op[2]] = value
        self._finished.put((msg["id"], started or time.perf_counter(), last))


def _routes(raw: Any) -> list:
    """Check a send's ``[[receiver, senders, [flat region, ...]], ...]``; regions become
    ((start, stop), ...) tuples."""
    if not isinstance(raw, list) or not raw:
        raise WireError("send routes must be a non-empty list")
    out = []
    for route in raw:
        if not (isinstance(route, list) and len(route) == 3 and isinstance(route[0], int)
                and isinstance(route[1], int) and route[1] >= 1 and isinstance(route[2], list)):
            raise WireError(f"send route {route!r} is not [receiver, senders >= 1, regions]")
        regions = []
        for flat in route[2]:
            flat = int_list(flat, "send region")
            if len(flat) % 2 or any(not 0 <= a <= b for a, b in zip(flat[::2], flat[1::2])):
                raise WireError(f"send region {flat} is not a flat list of [start, stop] pairs")
            regions.append(tuple(zip(flat[::2], flat[1::2])))
        out.append((route[0], route[1], regions))
    return out


def _session_of_message(msg: dict) -> int:
    if msg["t"] == "run":
        return session_of(msg["base"])
    return session_of(msg["handles"][0]) if msg.get("handles") else 0
