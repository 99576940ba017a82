"""One process of a multi-controller group: joins ``jax.distributed``, then either serves calls
from its :class:`pathways.spmd.Pool` or runs a script (``python -m pathways spmd``).

Started by the parent with its place in the group in the environment (``_ENV`` keys). Calls
arrive on an inherited socket as cloudpickled ``(fn, args, kwargs)``; the reply is the
result with every ``jax.Array`` turned into the numpy value of the whole array, so that a
process's reply does not depend on which shards it holds.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from pathways import config
from pathways.spmd._messages import Call, Exit, Raised, Ready, Returned



def initialize() -> None:
    """Configure JAX for this process's devices and join the group."""
    import jax

    processes = config.SPMD_PROCESSES.get()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", config.SPMD_DEVICES.get())
    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Bound to the coordinator's loopback address: by default jax binds every address ([::]:PORT).
        coordinator = config.SPMD_COORDINATOR.get()
        jax.distributed.initialize(coordinator, processes, config.SPMD_RANK.get(),
                                   initialization_timeout=int(config.SPMD_INIT_TIMEOUT.get()),
                                   coordinator_bind_address=coordinator)


def to_host(tree: Any) -> Any:
    """Every ``jax.Array`` leaf as the numpy value of the whole (global) array. Every process
    of the group must call this on the same structure: gathering a sharded array is a
    collective."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def leaf(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(leaf, tree)


def _serve(conn: Connection) -> None:
    import jax

    conn.send_bytes(cloudpickle.dumps(Ready(jax.process_index(), jax.device_count(), jax.local_device_count())))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the pool is gone
            return
        try:
            message = cloudpickle.loads(payload)
            if isinstance(message, Exit):
                return
            if not isinstance(message, Call):
                raise TypeError(f"an spmd process takes Call or Exit, not {type(message).__name__}")
            reply: Returned | Raised = Returned(to_host(message.fn(*message.args, **message.kwargs)))
        except BaseException as e:  # noqa: B036 - reported to the caller, which decides
            reply = Raised(type(e).__name__, str(e), traceback.format_exc())
        try:
            conn.send_bytes(cloudpickle.dumps(reply))
        except Exception as e:  # a result that cannot be pickled
            conn.send_bytes(cloudpickle.dumps(Raised(type(e).__name__, f"cannot send the result back: {e}",
                                                     traceback.format_exc())))


def main() -> None:
    from pathways.keeper import exit_with_parent

    exit_with_parent()
    # C++ libraries (gloo) print connection notices on fd 1: send fd 1 to stderr and keep
    # stdout, through a copy of the original fd, for the function's and the script's output.
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(stdout, "w", buffering=1)
    code = 0
    try:
        initialize()
        fd = config.SPMD_FD.get()
        if fd is not None:
            _serve(Connection(fd))
        else:
            script, *argv = sys.argv[1:]
            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: B036 - the traceback is this process's report
        traceback.print_exc()
        code = 1
    if code == 0 and config.SPMD_FD.get() is None:
        code = _leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    # jax.distributed's exit handler waits at a barrier for every process of the group,
    # which never comes when another one failed: a failed script's process exits at once.
    os._exit(code)


def _leave_group() -> int:
    """After the script succeeded: wait at jax.distributed's shutdown barrier for the other
    processes to finish theirs. Process 0 holds the group's coordination service, and the
    others abort when it goes away, so it must not exit before them. Should another process
    fail instead, the parent stops this one. Returns the exit code."""
    import jax

    if config.SPMD_PROCESSES.get() <= 1:
        return 0
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - the group broke after this script succeeded
        print(f"pathways spmd: leaving the group failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
