"""Multi-controller mode: the same JAX code as N processes under ``jax.distributed``.

This is the classic way to drive several hosts (every process runs the whole program on its
own devices), offered next to the single-controller runtime so that a workload can be run
and timed both ways. ``run``/``Pool`` start and stop the processes and bring results back;
``mesh`` and ``device_put`` are for use inside them.
"""

from __future__ import annotations

from typing import Any, Sequence

from pathways.spmd._child import to_host
from pathways.spmd._pool import Pool, launch, run

__all__ = ["Pool", "device_put", "launch", "mesh", "run", "to_host"]


def mesh(axis_names: str | Sequence[str], shape: Sequence[int] | None = None) -> Any:
    """A ``jax.sharding.Mesh`` over every device of the group, in process order, so that the
    leading axis runs across processes (as a pathways slice's mesh runs across hosts)."""
    import jax
    import numpy as np

    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    shape = tuple(shape) if shape is not None else (len(devices),) + (1,) * (len(names) - 1)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but axis_names {names} has {len(names)}")
    return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), names)


def device_put(x: Any, sharding: Any) -> Any:
    """A global ``jax.Array`` laid out by ``sharding`` from a host value that every process
    holds in full (each process keeps its own shards): a pytree of arrays, with one sharding
    or a matching pytree of them."""
    import jax
    import numpy as np

    def put(value: Any, s: Any) -> Any:
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, s, lambda index: value[index])

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda v: put(v, sharding), x)
    return jax.tree.map(put, x, sharding)
