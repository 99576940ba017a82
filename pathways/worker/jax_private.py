"""Every private JAX name a worker uses, in one module that adapts to each supported release.

A worker compiles StableHLO an IFRT proxy client sends, runs the loaded executable itself and
turns its buffers into ``jax.Array``s, and replaces the CPU backend's factory so that gloo
listens on the worker's own address: JAX has no public API for any of these. The names behind
them move between releases, so they are imported here only, and where a signature changed the
function here takes the form each release wants. ``check_version`` names the releases this
module was checked against; outside them a worker refuses to start, saying which to install,
instead of failing later inside a compile.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax
import numpy as np
from jax._src import core, distributed, xla_bridge
from jax._src.interpreters import mlir, pxla
from jax._src.lax import linalg
from jax._src.lib import _jax, xla_client
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.sharding_impls import GSPMDSharding

from pathways.errors import ConnectError

# the jax releases (lowest included, highest excluded) whose private names match this module
SUPPORTED = ((0, 9), (0, 13))

__all__ = ["GSPMDSharding", "core", "distributed", "hlo", "ir", "mlir", "pxla", "xla_bridge", "xla_client", "_jax",
           "SUPPORTED", "check_version", "array_result_handler", "colocated_device_ids", "gloo_cpu_client",
           "initialize_cpu_kernels"]


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_version(version: str = jax.__version__) -> None:
    """Raise ``ConnectError`` naming the supported range when ``version`` is outside it."""
    low, high = SUPPORTED
    if not low <= _release(version) < high:
        raise ConnectError(
            f"jax {version} is not supported by this pathways worker: it uses JAX internals checked against "
            f"jax >= {'.'.join(map(str, low))} and < {'.'.join(map(str, high))}; install a jax and jaxlib in "
            "that range (pip install 'jax<" + ".".join(map(str, high)) + "')")


# jaxlib up to 0.10 has ``array_result_handler(aval, sharding, committed, _skip_checks=False)``;
# 0.12 dropped the keyword. A nanobind function carries its signature in its doc.
_SKIP_CHECKS = "_skip_checks" in (xla_client.array_result_handler.__doc__ or "")


def array_result_handler(aval: Any, sharding: Any) -> Any:
    """JAX's own maker of a committed global ``jax.Array`` from an executable's per-device
    buffers of one output, without checks XLA already guarantees where the release offers it."""
    if _SKIP_CHECKS:
        return xla_client.array_result_handler(aval, sharding, committed=True, _skip_checks=True)
    return xla_client.array_result_handler(aval, sharding, True)


def gloo_cpu_client(hostname: str) -> Any:
    """A CPU client whose gloo collectives listen on ``hostname`` and tell peers that address;
    call it once ``jax.distributed`` is initialized."""
    collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                 hostname=hostname)
    return xla_bridge.make_cpu_client(collectives)


# JAX's colocated-Python pickles name devices through module-level functions of its
# serialization module, replaced while a worker reads or writes one: one at a time
_COLOCATED_IDS = threading.RLock()


@contextlib.contextmanager
def colocated_device_ids(by_client_id: dict[int, Any]) -> Iterator[Any]:
    """While open, JAX's colocated-Python pickles (``serialization._serialize`` and
    ``_deserialize``, yielded as that module) name devices by the client's ids: a pickle
    read gets the device ``by_client_id`` maps each id to, and a pickle written (the result
    specs the first call of a function finds) names each of those devices by the client's id."""
    from jax.experimental.colocated_python import serialization as s

    client_id = {d.id: i for i, d in by_client_id.items()}

    def named(device: Any) -> int:
        if device.id not in client_id:
            raise ValueError(f"device {device} is not one of the colocated call's devices")
        return client_id[device.id]

    def reduce_mesh(mesh: Any) -> Any:
        ids = np.vectorize(named, otypes=[int])(mesh.devices)
        return s._unreduce_mesh, (ids, mesh.axis_names, mesh.axis_types)

    def reduce_device_list(devices: Any) -> Any:
        return s._unreduce_device_list, ([named(d) for d in devices],)

    def reduce_single_device_sharding(sharding: Any) -> Any:
        (device,) = sharding.device_set
        return s._unreduce_single_device_sharding, (named(device), sharding.memory_kind)

    replaced = {"_get_cpu_device_map": lambda: by_client_id,
                "_reduce_mesh": s._make_reduce_func_with_common_obj(reduce_mesh),
                "_reduce_device_list": s._make_reduce_func_with_common_obj(reduce_device_list),
                "_reduce_single_device_sharding": s._make_reduce_func_with_common_obj(reduce_single_device_sharding)}
    with _COLOCATED_IDS:
        kept = {name: getattr(s, name) for name in replaced}
        for name, value in replaced.items():
            setattr(s, name, value)
        try:
            yield s
        finally:
            for name, value in kept.items():
                setattr(s, name, value)


def initialize_cpu_kernels() -> None:
    """Resolve the LAPACK routines behind jaxlib's CPU kernels of linear algebra (LU, QR,
    Cholesky, eigen- and singular-value decompositions, ...). JAX resolves them as it lowers
    such an operation or calls an exported function; a worker compiling StableHLO it was
    sent does neither, and an executable calling an unresolved one jumps to a null address
    (SIGSEGV). Idempotent; the first call imports SciPy's LAPACK (about 0.3 s)."""
    linalg.initialize_lapack()
