"""Arrays from and to the client's host buffers: a part of the IFRT session (IfrtSession),
working on its state. A host buffer becomes an array (put whole, in blocks, or streamed
to its worker as it arrives), and an array's bytes go into a host buffer as they come
from its workers."""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from pathways.ifrt import types as t
from pathways.ifrt import handling
from pathways.ifrt.devices import SliceDevices
from pathways.ifrt.handling import Deferred, IfrtArray, serves
from pathways.ifrt.host_buffers import HostBuffer
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Layout, evenly_divided, host_regions
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.wire import codec


class HostArrays:
    """IfrtSession's requests that move arrays between the client's host and the workers."""

    # ---- arrays from and to the host -----------------------------------------------------------

    def _host_array(self, handle: int, dtype: np.dtype, shape: tuple[int, ...],
                    strides: Optional[list[int]]) -> np.ndarray:
        # taken: the put keeps the bytes alive as long as it needs them
        try:
            buffer = self.buffers.get(handle, 0.0, take=True)
        except IfrtError:  # not stored yet: what the server holds back (runs) must not wait for it
            self.native.send_held()
            buffer = self.buffers.get(handle, handling.HOST_BUFFER_WAIT, take=True)
        return t.host_view(buffer, dtype, shape, strides)

    @serves("array_handle")
    def _make_array_from_host_buffer_request(self, body: pb.MakeArrayFromHostBufferRequest) -> Any:
        dtype, shape = t.dtype_of(body.dtype), t.shape_of(body.shape.dims)
        sharding = t.parse_sharding(body.sharding, len(self._table))
        strides = t.byte_strides_of(body, "byte_strides")
        arr = self._streamed_put(body.host_buffer_handle, dtype, shape, strides, sharding)
        if arr is None:
            if not t.c_contiguous(dtype, shape, strides):
                # the put lays the view out in C order a chunk at a time as it sends it
                # (codec.array_chunks), never whole here: still, a few bytes of buffer may
                # stand for gigabytes, so the array counts at its full size
                self.buffers.admit(math.prod(shape) * dtype.itemsize,
                                   f"a {dtype.name}{list(shape)} array made from a strided host buffer")
            arr = self._put(self._host_array(body.host_buffer_handle, dtype, shape, strides), sharding)
        handles = self._insert([body.array_handle] if body.HasField("array_handle") else [], [arr])
        return pb.MakeArrayFromHostBufferResponse(array_handle=handles[0])

    @serves("array_handles")
    def _make_arrays_from_host_buffer_shards_request(self, body: Any) -> Any:
        arrays = []
        for spec in body.specs:
            dtype, shape = t.dtype_of(spec.array_spec.dtype), t.shape_of(spec.array_spec.shape.dims)
            sharding = t.parse_sharding(spec.array_spec.sharding, len(self._table))
            if len(spec.addressable_shard_indices) != len(spec.host_buffers):
                raise t.invalid(f"{len(spec.addressable_shard_indices)} shard index lists for "
                                f"{len(spec.host_buffers)} host buffers")
            regions = t.shard_regions(sharding, shape)
            blocks: dict[t.Region, np.ndarray] = {}  # each block of the array a host buffer holds
            partial = t.is_unreduced(sharding.op)
            own: dict[int, np.ndarray] = {}  # an unreduced array's: each device's partial value
            for indices, hb in zip(spec.addressable_shard_indices, spec.host_buffers):
                if t.dtype_of(hb.dtype) != dtype:
                    raise t.invalid(f"a host buffer of dtype {t.dtype_of(hb.dtype)} for an array of {dtype}")
                shard = self._host_array(hb.host_buffer_handle, dtype, t.shape_of(hb.shape.dims),
                                         t.byte_strides_of(hb, "byte_strides"))
                for i in indices.indices:
                    if not 0 <= i < len(regions):
                        raise t.invalid(f"shard index {i} is not one of the sharding's {len(regions)} shards")
                    region = regions[i]
                    if tuple(b - a for a, b in region) != shard.shape:
                        raise t.invalid(f"shard {i} has shape {list(shard.shape)}; the sharding gives it "
                                        f"{[b - a for a, b in region]}")
                    if partial:
                        own[i] = shard
                    else:
                        blocks[region] = shard
            if partial:
                arrays.append(self._put_partials(dtype, shape, sharding, own))
                continue
            if not blocks:
                raise t.invalid("an array needs at least one host buffer shard")
            arrays.append(self._put_blocks(dtype, shape, sharding, blocks))
        handles = self._insert(list(body.array_handles), arrays)
        return pb.MakeArraysFromHostBufferShardsResponse(array_handles=handles)

    @serves("array_handles")
    def _make_error_arrays_request(self, body: Any) -> Any:
        error = IfrtError(body.error.code or t.INTERNAL, body.error.message[:4096])
        arrays = [IfrtArray(t.dtype_of(s.dtype), t.shape_of(s.shape.dims),
                            t.parse_sharding(s.sharding, len(self._table)), error=error) for s in body.array_specs]
        return pb.MakeErrorArraysResponse(array_handles=self._insert(list(body.array_handles), arrays))

    def _put_blocks(self, dtype: np.dtype, shape: tuple[int, ...], sharding: Sharding,
                    blocks: dict[t.Region, np.ndarray]) -> IfrtArray:
        """The array of ``dtype`` and ``shape`` whose blocks the client's host buffers hold
        (``blocks``: region -> its value, maybe a strided view), put without a copy of it
        here where each block a worker holds lies within one of them (one host buffer per
        shard: the usual case) or one of them is the whole array; else assembled first."""
        nbytes = math.prod(shape) * dtype.itemsize
        whole = blocks.get(tuple((0, d) for d in shape))
        pieces = None if whole is not None else self._worker_pieces(shape, sharding, blocks)
        strided = any(not b.flags.c_contiguous for b in blocks.values())
        if strided or (whole is None and pieces is None):
            # a strided block is laid out as it is sent, an assembly is a copy here: either
            # way the bytes the request stands for are the whole array's, not its buffers'
            self.buffers.admit(nbytes, f"a {dtype.name}{list(shape)} array made from "
                                       f"{'strided host buffers' if strided else 'shards assembled here'}")
        if whole is not None:
            return self._put(whole, sharding)
        if pieces is not None:
            place, layout, of_worker = pieces
            handle = self.native.allocate(1)
            moves = self.native.moves  # before the addresses: a move in between makes the controller drop the put
            self.native.put_pieces(place.addresses, handle, layout, dtype, shape, of_worker, moves)
            return IfrtArray(dtype, shape, sharding, handle, layout, place)
        value = np.empty(shape, dtype)
        for region, block in blocks.items():
            value[tuple(slice(a, b) for a, b in region)] = block
        return self._put(value, sharding)

    def _worker_pieces(self, shape: tuple[int, ...], sharding: Sharding, blocks: dict[t.Region, np.ndarray]
                       ) -> Optional[tuple[SliceDevices, Layout, dict[int, list[codec.Piece]]]]:
        """Where and how an array laid out by ``sharding`` goes, and each worker's blocks of
        it cut from ``blocks`` (views, no copy); None where a worker's block lies within no
        one of them, or the array is not laid out in even blocks on one island."""
        if len(self._table.islands(sharding.devices)) > 1:
            return None
        place, layout = self._table.layout(sharding, len(shape))
        if layout.unreduced or not evenly_divided(shape, layout):
            return None
        of_worker: dict[int, list[codec.Piece]] = {}
        for worker, regions in host_regions(shape, layout).items():
            mine = of_worker[worker] = []
            for region in regions:
                home = region if region in blocks else next(
                    (r for r in blocks if all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(region, r))), None)
                if home is None:
                    return None
                mine.append((region, blocks[home][tuple(slice(a - a0, b - a0)
                                                        for (a, b), (a0, _) in zip(region, home))]))
        return place, layout, of_worker

    def _streamed_put(self, handle: int, dtype: np.dtype, shape: tuple[int, ...], strides: Optional[list[int]],
                      sharding: Sharding) -> Optional[IfrtArray]:
        """The array of host buffer ``handle`` put on its worker chunk by chunk as the
        buffer arrives, without waiting for it; None where it goes whole (small, strided,
        unreduced, or not held whole by one worker)."""
        assert self.devices is not None
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= handling.STREAMED_PUT_BYTES or not t.c_contiguous(dtype, shape, strides):
            return None
        if len(self.devices.islands(sharding.devices)) > 1:
            return None
        place, layout = self.devices.layout(sharding, len(shape))
        if len(layout.workers) != 1 or layout.unreduced:
            return None
        pw_handle = self.native.allocate(1)
        moves = self.native.moves  # before the address: a move in between makes the controller drop the put
        chunks = _exactly(nbytes, f"a {dtype.name}{list(shape)} array",
                          self.buffers.chunks(handle, handling.HOST_BUFFER_WAIT, take=True))
        self.native.put_chunks(place.addresses[0], pw_handle, layout, dtype, shape, chunks, moves)
        return IfrtArray(dtype, shape, sharding, pw_handle, layout, place)

    @serves()
    def _copy_to_host_buffer_request(self, body: pb.CopyToHostBufferRequest) -> Deferred:
        """Answered at once: the client's lookup of the buffer then gets its bytes as
        they arrive from the worker (or the error that stopped them)."""
        arr = self._array(body.array_handle)
        strides = t.byte_strides_of(body, "byte_strides")
        target = arr.group.parent if arr.group is not None else arr
        if target.token:  # as JAX's own runtime says it
            raise IfrtError(t.INVALID_ARGUMENT, "Cannot convert a token-shape buffer to a numpy array.")
        done = self._reads(target.handles)
        try:
            buffer = self.buffers.open(body.host_buffer_handle, None)
        except BaseException:
            done()
            raise

        def run() -> None:
            try:
                if target.held is not None:  # strings, held here
                    self.buffers.add(buffer, memoryview(t.string_host_buffer(self._host_value(arr))))
                    self.buffers.finish(buffer)
                    return
                contiguous = t.c_contiguous(arr.dtype, arr.shape, strides)
                value = self._computed_value(arr) if contiguous else None
                if value is not None:
                    self.buffers.add(buffer, memoryview(value.reshape(-1).view(np.uint8)))
                elif arr.group is None and not arr.parts and contiguous and len(self._addresses(arr)) == 1:
                    self._fetch(arr, data=True, sink=lambda header, chunks: self._receive(buffer, arr, header, chunks))
                else:
                    self.buffers.add(buffer, memoryview(t.strided_bytes(self._host_value(arr), strides)))
                self.buffers.finish(buffer)
            except Exception as e:
                self.buffers.fail(buffer, e if isinstance(e, IfrtError) else t.runtime_failure(e))
            finally:
                done()
        return Deferred(run, answer=pb.CopyToHostBufferResponse())

    def _receive(self, buffer: HostBuffer, arr: IfrtArray, header: dict, chunks: Iterator[bytes]) -> None:
        """A worker's reply holding ``arr`` into ``buffer``: its chunks as they come when
        they are the whole array in C order, else the pieces assembled first."""
        dtype, shape, specs = codec.piece_specs(header)
        if (dtype, shape) != (arr.dtype, arr.shape):
            raise IfrtError(t.INTERNAL, f"the worker sent a {dtype.name}{list(shape)} array for a "
                                        f"{arr.dtype.name}{list(arr.shape)} one")
        if [index for index, _ in specs] == [codec.full_region(shape)]:
            for chunk in codec.exact_chunks(math.prod(shape) * dtype.itemsize, chunks):
                self.buffers.add(buffer, chunk)
            return
        assembly = codec.Assembly(dtype, shape)
        assembly.add(codec.read_pieces(header, chunks)[2])
        self.buffers.add(buffer, memoryview(t.strided_bytes(assembly.result(), None)))


def _exactly(nbytes: int, what: str, chunks: Iterable[Any]) -> Iterator[Any]:
    """``chunks``, checked to hold ``nbytes`` bytes in all: IfrtError naming ``what`` for
    fewer or more."""
    got = 0
    for chunk in chunks:
        got += memoryview(chunk).nbytes
        if got > nbytes:
            raise t.invalid(f"the host buffer has more bytes than {what} needs ({nbytes})")
        yield chunk
    if got != nbytes:
        raise t.invalid(f"the host buffer has {got} bytes; {what} needs {nbytes}")
