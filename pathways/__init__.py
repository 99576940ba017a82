"""pathways: a single-controller runtime for JAX.

One Python client drives many worker hosts: request virtual device slices, compile JAX
functions onto them with ``pw.pmap``/``pw.jit``, and trace several into one ``@pw.program``.

The client's API is imported on first use (``pw.jit``, ``from pathways import jit``): every
module of the package runs this file first, and the controller, a worker, the wire and the
protocol must not load JAX and the client for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from pathways.errors import (AccessDeniedError, ArrayDeletedError, AuthenticationError, ConnectError,
                             ControllerLostError, DeadlineExceededError, PathwaysError, PlacementError,
                             ProgramTraceError, RemoteError, ResourceExhaustedError, SignatureError, SpmdError,
                             SuspendedError, WireError, WorkerLostError)

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError", "Array", "ArrayDeletedError", "AuthenticationError", "ConnectError", "ControllerLostError",
    "DeadlineExceededError", "Island", "NamedSharding",
    "P", "PartitionSpec", "PathwaysError", "PlacementError", "ProgramTraceError", "RemoteError",
    "ResourceExhaustedError", "SignatureError", "Slice", "SpmdError", "SuspendedError", "VirtualDeviceSet", "VirtualMesh", "WireError", "WorkerLostError", "conduct",
    "connect", "default_session", "device_get", "device_put", "disconnect", "jit", "local_cluster",
    "load", "make_virtual_device_set", "pipeline", "pmap", "program", "resume", "save", "spmd", "suspend", "trace",
]

# Modules of the public API reached as attributes (`pw.spmd.run`, `pw.cluster.measure`):
# each is imported alone, without the client.
_MODULES = ("cluster", "planner", "spmd")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in __all__:  # a submodule not imported yet: `from pathways import keeper` imports it next
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from jax.sharding import PartitionSpec

    from pathways.client.api import (connect, default_session, device_get, device_put, disconnect, load,
                                     local_cluster, make_virtual_device_set, resume, save, suspend, trace)
    from pathways.client.array import Array
    from pathways.client.compiled import jit, pmap
    from pathways.client.devices import NamedSharding, Slice, VirtualDeviceSet, VirtualMesh
    from pathways.client.pipeline import pipeline
    from pathways.client.program import program
    from pathways.cluster import Island
    from pathways.conductor import conduct

    P = PartitionSpec
    api = locals()
    globals().update((n, api[n]) for n in __all__ if n in api)
    return api[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
