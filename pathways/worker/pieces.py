"""The blocks of a jax array this host holds, as pieces (wire/codec.py: (region, numpy
array)), and a jax shard index as a region: what a worker sends, offloads and answers
fetches with."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pathways.errors import WireError
from pathways.wire import codec
from pathways.worker.shared_arrays import shareable


def local_pieces(value: Any) -> tuple[Any, tuple[int, ...], list]:
    """The distinct shards of ``value`` this host holds, as (index, numpy array). Raises the
    error of a computation that failed after it was dispatched (reading such an array's
    buffer would abort the process)."""
    shareable(value).block_until_ready()
    shape = tuple(value.shape)
    if value.is_fully_addressable and len(value.sharding.device_set) == 1:
        return value.dtype, shape, [(codec.full_region(shape), np.asarray(value))]
    pieces, seen = [], set()
    for shard in value.addressable_shards:
        index = region_of(shard.index, shape)
        if index not in seen:
            seen.add(index)
            pieces.append((index, np.asarray(shard.data)))
    return value.dtype, shape, pieces


def device_piece(value: Any, device: Any) -> tuple[Any, tuple[int, ...], list]:
    """The one shard of ``value`` on jax device ``device``, as local_pieces gives pieces:
    that device's own buffer, though another device may hold the same block (an unreduced
    array's devices hold different partial values of it). WireError if it holds none."""
    shareable(value).block_until_ready()
    shape = tuple(value.shape)
    for shard in value.addressable_shards:
        if shard.device == device:
            return value.dtype, shape, [(region_of(shard.index, shape), np.asarray(shard.data))]
    raise WireError(f"the array holds no shard on {device}; it is on {sorted(d.id for d in value.sharding.device_set)}")


def region_of(index: tuple, shape: tuple[int, ...]) -> tuple:
    """A jax shard index (a tuple of slices) as ((start, stop), ...)."""
    return tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in zip(index, shape))


@functools.lru_cache(maxsize=4096)
def host_regions(sharding: Any, shape: tuple[int, ...]) -> list:
    """The distinct blocks of an array of ``shape`` that this host's devices hold."""
    out: list = []
    for index in sharding.addressable_devices_indices_map(shape).values():
        region = region_of(index, shape)
        if region not in out:
            out.append(region)
    return out
