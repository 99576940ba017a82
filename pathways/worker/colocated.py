"""Colocated Python on a worker: a part of the worker's core (WorkerCore), working on its
state. JAX's ``colocated_python`` pickles a function with the specs of its arguments and
results; each host of the call unpickles it, calls it with the session's arrays as this
host holds them, and stores its results under the handles the client chose.

The arrays are those the worker keeps: global jax.Arrays over the island's devices, this
host's shards addressable, as in multi-controller JAX, so a function that works on its
shards (``x + 1``, a data loader filling its part of a batch) runs on every host of the
call at once. Its results are stored as the request lays them out (resharded here where
the function returned another sharding). A result of strings (JAX's way of telling the
client the result specs it found on the first call) is answered in the reply instead.

This runs the client's code on the host, with the worker's rights: the same trust as any
program a session runs, admitted with the session's credential, on that session's arrays
only. A function that raises, or returns what the specs do not describe, fails the call
and poisons its results with why. Functions run outside the island's gang order, beside
its programs: collectives across hosts inside them are not supported."""

from __future__ import annotations

import time
import traceback
from typing import Callable

import jax
import numpy as np

from pathways.errors import (AccessDeniedError, DeadlineExceededError, PathwaysError, RemoteError,
                             ResourceExhaustedError, WireError)
from pathways.ir import Layout
from pathways.protocol.errors import POISON_KINDS, REMOTE, error_of, kind_of
from pathways.protocol.handles import session_of
from pathways.protocol.messages import ColocatedDone, ColocatedRequest, device_pairs
from pathways.worker import jax_private
from pathways.worker.store import Poison

class Colocated:
    """WorkerCore's colocated Python calls."""

    def run_colocated(self, req: ColocatedRequest, still_wanted: Callable[[], bool]) -> ColocatedDone:
        """Run the request's function on this host's shards of its inputs, once they are
        computed (within ``req.wait`` seconds), and store its results. Raises the error to
        answer; a failure after admission poisons every result with why."""
        # the session first: a call naming no array must not run (or unpickle) anything either
        self.sessions.admit_session(req.session, req.credential, "colocated Python call")
        handles = (*req.inputs, *(o.handle for o in req.outputs if o.handle))
        strangers = [h for h in handles if session_of(h) != req.session]
        if strangers:
            raise AccessDeniedError(f"this worker refused a colocated Python call of session {req.session}: array "
                                    f"{strangers[0]:#x} is not that session's. A client runs functions on the arrays "
                                    "it created itself only")
        if not self.colocated_python:
            raise AccessDeniedError(f"worker {self.worker_id} runs no colocated Python: it would run the client's "
                                    "code in the worker's process, and its operator did not allow that (`pathways "
                                    "worker --colocated-python`, `pathways up --colocated-python`, "
                                    "pw.local_cluster(colocated_python=True))")
        session = req.session
        waits = bool(req.inputs) and req.wait > 0 and self.fetch_waits.slot(session)
        try:
            return self._run_colocated(req, req.wait if waits else 0.0, still_wanted)
        except Exception as e:
            kind = kind_of(e) if isinstance(e, PathwaysError) else REMOTE
            message = f"worker {self.worker_id}: {e if isinstance(e, PathwaysError) else _described(e)}"
            for out in req.outputs:
                if out.layout is not None and self._holds(out.layout):  # what another host holds is its to poison
                    self._poisoned(out.handle, Poison(message, kind if kind in POISON_KINDS else REMOTE))
            raise (e if isinstance(e, PathwaysError) else RemoteError(message)) from None
        finally:
            if waits:
                self.fetch_waits.release(session)

    def _run_colocated(self, req: ColocatedRequest, wait: float, still_wanted: Callable[[], bool]) -> ColocatedDone:
        deadline = time.monotonic() + wait
        values = []
        for handle in req.inputs:
            value = self.store.wait_computed(handle, deadline, still_wanted)
            if value is None:
                raise DeadlineExceededError(f"argument {handle:#x} was not computed within {wait:g} s on worker "
                                            f"{self.worker_id}")
            if type(value) is Poison:
                raise error_of(value.kind, f"argument {handle:#x}: {value.message}")
            values.append(value)
        devices = {i: self.executables.device(pair) for i, pair in zip(req.device_ids, device_pairs(req.devices))}
        with jax_private.colocated_device_ids(devices) as serialization:
            fun, in_tree, in_specs, _, out_specs, _ = serialization._deserialize(req.program)
        if len(in_specs) != len(values) or len(out_specs) != len(req.outputs):
            raise WireError(f"the function takes {len(in_specs)} arrays and returns {len(out_specs)}; the call "
                            f"passes {len(values)} and stores {len(req.outputs)}")
        for i, (value, spec) in enumerate(zip(values, in_specs)):
            if (value.shape, value.dtype) != (spec.shape, spec.dtype):
                raise WireError(f"argument {i} is a {value.dtype}{list(value.shape)} array; the function takes a "
                                f"{spec.dtype}{list(spec.shape)} one")
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, values)
        if any(out.layout is None for out in req.outputs):
            # a string result is the result specs the function found, pickled naming devices
            with jax_private.colocated_device_ids(devices):
                results = jax.tree_util.tree_leaves(fun(*args, **kwargs))
        else:
            results = jax.tree_util.tree_leaves(fun(*args, **kwargs))
        if len(results) != len(req.outputs):
            raise RemoteError(f"the function returned {len(results)} arrays; its specs say {len(req.outputs)}")
        texts = []
        for i, (result, out, spec) in enumerate(zip(results, req.outputs, out_specs)):
            if not isinstance(result, jax.Array) or (result.shape, result.dtype) != (spec.shape, spec.dtype):
                got = (f"a {result.dtype}{list(result.shape)} array" if isinstance(result, jax.Array)
                       else f"a {type(result).__name__}")
                raise RemoteError(f"result {i} is {got}; its spec says {spec.dtype}{list(spec.shape)}")
            if out.layout is None:  # a string result: its value goes back in the reply
                texts.append(str(np.asarray(result.addressable_shards[0].data).item()).encode())
                continue
            if not self._holds(out.layout):  # none of it is this host's to keep
                continue
            target = self.executables.sharding(out.layout)
            if not result.sharding.is_equivalent_to(target, result.ndim):
                result = jax.device_put(result, target)
            refusal = self.store.put_charged(out.handle, result)
            if refusal is not None:
                raise ResourceExhaustedError(refusal)
        return ColocatedDone(tuple(texts))

    def _holds(self, layout: Layout) -> bool:
        """Whether this host holds a part of an array laid out as ``layout``."""
        try:
            return bool(self.executables.sharding(layout).addressable_devices)
        except WireError:  # devices its island lacks: none of them is this host's
            return False


def _described(error: Exception) -> str:
    """A function's exception, with where the client's code raised it (a pickled function's
    file is not known here; its name and line are)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (raised in {frames[-1].name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"
