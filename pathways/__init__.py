"""pathways: a single-controller runtime for JAX.

One Python client drives many worker hosts: request virtual device slices, compile JAX
functions onto them with ``pw.pmap``/``pw.jit``, and trace several into one ``@pw.program``.

The names below are imported from their modules when first used (PEP 562): importing the
package loads nothing, so that the processes that never touch JAX (a controller, the host
process of a worker before it becomes the worker's keeper, ``pathways status``) start
without importing it, about a second of CPU each that a cluster's start-up would pay.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# module -> the names it gives the package (a literal: tests/test_imports.py reads it)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "jax.sharding": ("PartitionSpec",),
    "pathways.client.api": ("connect", "default_session", "device_get", "device_put", "disconnect", "local_cluster",
                            "make_virtual_device_set", "resume", "suspend", "trace"),
    "pathways.client.array": ("Array",),
    "pathways.client.compiled": ("jit", "pmap"),
    "pathways.client.devices": ("NamedSharding", "Slice", "VirtualDeviceSet", "VirtualMesh"),
    "pathways.client.pipeline": ("pipeline",),
    "pathways.client.program": ("program",),
    "pathways.cluster": ("Island",),
    "pathways.errors": ("AccessDeniedError", "ArrayDeletedError", "AuthenticationError", "ConnectError",
                        "ControllerLostError", "DeadlineExceededError", "PathwaysError", "PlacementError",
                        "ProgramTraceError", "RemoteError", "SignatureError", "SpmdError", "SuspendedError",
                        "WireError", "WorkerLostError"),
}
_ALIASES = {"P": "PartitionSpec"}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted([*_MODULE_OF, *_ALIASES, "spmd"])


def __getattr__(name: str) -> Any:
    if name == "spmd":  # a subpackage: importing it sets the package's attribute
        import pathways.spmd
        return globals()["spmd"]
    attribute = _ALIASES.get(name, name)
    if attribute not in _MODULE_OF:
        raise AttributeError(f"module 'pathways' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[attribute]), attribute)
    globals()[name] = value  # later uses find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
