"""The pathways operations an IFRT session's requests are made of: a part of the session
(IfrtSession), working on its state. Puts (of an array on one island, of the partial
values of an unreduced one, of one laid out across islands), the addresses and fetches
of an array's data, and its value here."""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Optional, Sequence

import numpy as np

from pathways import errors
from pathways.client.fetches import Sink
from pathways.ifrt import types as t
from pathways.ifrt import handling
from pathways.ifrt.devices import SliceDevices
from pathways.ifrt.handling import IfrtArray, shard_of_deleted
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Layout, device_regions, evenly_divided, partials, reading_positions, stacked


class NativeOps:
    """IfrtSession's puts and reads through its native session."""

    # ---- native operations -----------------------------------------------------------------

    def _put(self, value: np.ndarray, sharding: Sharding) -> IfrtArray:
        assert self.devices is not None
        islands = self.devices.islands(sharding.devices)
        if len(islands) > 1:
            return self._put_parts(value, sharding, islands)
        place, layout = self.devices.layout(sharding, value.ndim)
        if layout.unreduced:
            raise IfrtError(t.UNIMPLEMENTED, "an unreduced array is made of its devices' partial values "
                                             "(jax.make_array_from_single_device_arrays), not of one host value")
        return self._put_on(place, layout, value, tuple(value.shape), sharding)

    def _put_on(self, place: SliceDevices, layout: Layout, value: np.ndarray, shape: tuple[int, ...],
                sharding: Sharding) -> IfrtArray:
        """An array of ``shape`` put on ``place`` laid out by ``layout``: ``value``, or for an
        unreduced layout the stack of its partial values."""
        handle = self.native.allocate(1)
        moves = self.native.moves  # before the addresses: a move in between makes the controller drop the put
        self.native.put(place.addresses, handle, layout, value, moves)
        return IfrtArray(value.dtype, shape, sharding, handle, layout, place)

    def _put_partials(self, dtype: np.dtype, shape: tuple[int, ...], sharding: Sharding,
                      own: dict[int, np.ndarray]) -> IfrtArray:
        """An unreduced array from ``own``: the partial value of its block each device holds
        (by position in ``sharding.devices``), put as their stack (ir.stacked), which keeps
        every device's own."""
        missing = [i for i in range(len(sharding.devices)) if i not in own]
        if missing:
            raise t.invalid(f"an unreduced array needs every device's partial value; shard(s) {missing[:16]} "
                            "have none")
        if len(self._table.islands(sharding.devices)) > 1:
            raise IfrtError(t.UNIMPLEMENTED, "an unreduced array laid out across islands is not supported; lay it "
                                             "out on one island's devices")
        place, layout = self._table.layout(sharding, len(shape))
        if not evenly_divided(shape, layout):
            raise IfrtError(t.UNIMPLEMENTED, f"an unreduced array of shape {list(shape)} must split evenly over "
                                             "its sharding's tiles")
        stack = np.empty((partials(layout), *shape), dtype)
        if math.prod(stack.shape) * dtype.itemsize > self.buffers.limit:
            raise IfrtError(t.RESOURCE_EXHAUSTED, f"the {stack.shape[0]} partial values of a {dtype.name}{list(shape)} "
                                                  f"array need more than {self.buffers.limit} bytes here")
        blocks = device_regions(stack.shape, stacked(layout))  # in the layout's device order
        position = {pair: j for j, pair in enumerate(layout.devices)}
        for i, block in own.items():
            d = self._table.get(sharding.devices[i])
            region = blocks[position[(d.rank, d.index)]]
            if tuple(b - a for a, b in region[1:]) != block.shape:
                raise t.invalid(f"shard {i} has shape {list(block.shape)}; the sharding gives it "
                                f"{[b - a for a, b in region[1:]]}")
            stack[tuple(slice(a, b) for a, b in region)] = block
        return self._put_on(place, layout, stack, shape, sharding)

    def _put_parts(self, value: np.ndarray, sharding: Sharding, islands: list[list[int]]) -> IfrtArray:
        """``value`` laid out across islands: each island's box of it put on that island."""
        shape = tuple(value.shape)
        cuts = [t.island_part(sharding, shape, positions) for positions in islands]  # all checked before any put
        parts: list[tuple[t.Region, IfrtArray]] = []
        try:
            for box, part in cuts:
                parts.append((box, self._put(value[tuple(slice(a, b) for a, b in box)], part)))
        except BaseException:
            for _, arr in parts:
                self.native.release(arr.handle)
            raise
        return IfrtArray(value.dtype, shape, sharding, parts=tuple(parts))

    @staticmethod
    def _addresses(arr: IfrtArray, rank: Optional[int] = None) -> tuple[str, ...]:
        """The workers a read of ``arr`` asks, where they are now (with ``rank``: the host
        of that island rank alone)."""
        place = arr.place
        assert place is not None
        if rank is not None:
            return (place.addresses[place.workers.index(place.workers_by_rank[rank])],)
        if arr.sharding.replicated:
            return place.addresses[:1]
        if arr.layout is None:
            return place.addresses
        # a block replicated on several hosts comes from one of them
        workers = arr.layout.workers
        return tuple(place.addresses[place.workers.index(workers[i])] for i in reading_positions(arr.shape, arr.layout))

    def _fetch(self, arr: IfrtArray, data: bool, device: Optional[int] = None, sink: Optional[Sink] = None,
               wait: float = handling.WAIT_SECONDS) -> Any:
        """The array's value (``data``) or its readiness, from the workers, waiting up to
        ``wait`` seconds for it to be computed. With ``device`` (an IFRT id): the buffer of
        that device of the array alone. With ``sink``: each worker's reply goes there as it
        arrives (Session.fetch)."""
        assert arr.handle is not None and arr.place is not None
        pair = None
        if device is not None:
            d = self._table.get(device)
            pair = (d.rank, d.index)
        addresses = functools.partial(self._addresses, arr, None if pair is None else pair[0])
        try:
            value = self.native.fetch(addresses, arr.handle, wait, data, pair, sink)
        except errors.PathwaysError as e:
            raise t.runtime_failure(e) from None
        if value is None:
            raise IfrtError(t.DEADLINE_EXCEEDED, f"the array was not computed within {handling.WAIT_SECONDS:g} s")
        return value

    def _computed_value(self, arr: IfrtArray) -> Optional[np.ndarray]:
        """``arr``'s value as the controller sent it with the news that the jit call making
        it finished (small outputs held whole by one worker: client/computed.py), waiting
        for that news; None where none comes (the caller then asks the workers)."""
        unreduced = arr.layout is not None and arr.layout.unreduced  # its devices' partial values are read one by one
        if arr.handle is None or arr.group is not None or arr.parts or unreduced:
            return None
        if not self.native.wait_computed([arr.handle], handling.WAIT_SECONDS):
            return None
        raw = self.native.computations.value(arr.handle)
        if raw is None or len(raw) != math.prod(arr.shape) * arr.dtype.itemsize:
            return None
        return np.frombuffer(raw, arr.dtype).reshape(arr.shape)

    def _host_value(self, arr: IfrtArray) -> np.ndarray:
        if arr.error is not None:
            raise arr.error
        if arr.held is not None:
            return arr.held
        if arr.parts:
            return self._assembled(arr)
        if arr.group is None:
            value = self._computed_value(arr)
            return value if value is not None else self._fetch(arr, data=True)
        group = arr.group
        assert arr.region is not None
        parent = group.parent
        if parent.deleted and group.value is None:
            raise shard_of_deleted()
        if parent.layout is not None and parent.layout.unreduced:
            # each device holds a partial value of its block, not a replica: a shard is
            # read from its own device
            device = arr.sharding.devices[0]
            block = t.shard_regions(parent.sharding, parent.shape)[parent.sharding.devices.index(device)]
            shard = self._fetch(parent, data=True, device=device)
            return shard[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(arr.region, block))]
        with group.lock:  # the parent is fetched once for all its views
            if group.value is None:
                group.value = self._host_value(group.parent)
            value = group.value
        # an array still where the block is a scalar: numpy would give its element
        return np.asarray(value[tuple(slice(a, b) for a, b in arr.region)], dtype=value.dtype)

    def _assembled(self, arr: IfrtArray) -> np.ndarray:
        """An array laid out across islands, fetched island by island; an island holding
        the whole array (replicated across islands) is the only one asked."""
        full = tuple((0, d) for d in arr.shape)
        whole = [p for box, p in arr.parts if box == full]
        if whole:
            return self._fetch(whole[0], data=True)
        value = np.empty(arr.shape, arr.dtype)
        done = set()
        for box, part in arr.parts:
            if box not in done:  # islands holding the same box: one fetch
                done.add(box)
                value[tuple(slice(a, b) for a, b in box)] = self._fetch(part, data=True)
        return value

    def _real(self, arr: IfrtArray) -> IfrtArray:
        """``arr`` as an array on the workers: a view is made one (its shard is put)."""
        if arr.group is None:
            return arr
        real = self._put(np.ascontiguousarray(self._host_value(arr)), arr.sharding)
        self._drop(arr)  # no longer a view
        arr.handle, arr.layout, arr.place, arr.group, arr.region = real.handle, real.layout, real.place, None, None
        self._retain(arr)
        return arr

    def _wait_ready(self, arrays: Sequence[IfrtArray]) -> None:
        for arr in arrays:
            if arr.error is not None:
                raise arr.error
            target = arr.group.parent if arr.group is not None else arr
            if target.error is not None:
                raise target.error
            if target.deleted and target is not arr:
                raise shard_of_deleted()
            if target.held is not None:
                continue
            parts = [p for _, p in target.parts] or [target]
            began = time.monotonic()
            if self.native.wait_computed([p.handle for p in parts], handling.WAIT_SECONDS):
                continue  # the controller said so; else the workers say what became of them
            left = max(handling.WAIT_SECONDS - (time.monotonic() - began), 0.0)
            for part in parts:
                self._fetch(part, data=False, wait=left)
