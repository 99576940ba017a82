"""Shards, views and copies of arrays: a part of the IFRT session (IfrtSession), working on
its state. A shard of an array is a view of its block (read through the parent), arrays
are assembled from shards and remapped, and a copy to other devices is a run of an
identity function on the destination layout."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np

from pathways.client.compiled import define_function, register_program, value_types
from pathways.ifrt import types as t
from pathways.ifrt.devices import SliceDevices
from pathways.ifrt.handling import IfrtArray, ViewGroup, serves
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Layout, Node, ProgramGraph
from pathways.platforms import export_platforms
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.proto.xla.python.ifrt_proxy.common import types_pb2


class Views:
    """IfrtSession's requests that cut, assemble, remap and copy arrays."""

    # ---- shards and views ------------------------------------------------------------------------

    def _view(self, arr: IfrtArray, index: int, region: t.Region, group: Optional[ViewGroup]) -> IfrtArray:
        device = arr.sharding.devices[index]
        if arr.group is not None:  # a view of a view: the same parent, a block of its block
            base = arr.region or ()
            region = tuple((o + a, o + b) for (o, _), (a, b) in zip(base, region))
            group = arr.group
        return IfrtArray(arr.dtype, tuple(b - a for a, b in region), t.replicated((device,)), group=group,
                         region=region)

    @staticmethod
    def _shard(arr: IfrtArray) -> IfrtArray:
        """The one shard of single-device array ``arr``: a new IFRT array that is ``arr``, as
        a view of it. JAX keeps it as ``arr``'s cached shard (np.asarray reads it, and
        x.addressable_shards hands it out) and, on x.delete(), deletes ``arr`` alone,
        expecting the data to go, as the buffers the two share do in JAX's own runtimes: so
        ``arr``'s delete frees the data at once (the shard then refuses reads), and
        otherwise the data stays while either of them lives."""
        if arr.group is not None:  # a view's shard: another view of the same block
            return dataclasses.replace(arr)
        return dataclasses.replace(arr, alias_of=arr.alias_of if arr.alias_of is not None else arr)

    @serves("result_handle")
    def _fully_replicated_shard_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle)
        if not arr.sharding.replicated:
            raise t.invalid(f"array {body.array_handle} is not fully replicated")
        if len(arr.sharding.devices) == 1:
            shard = self._shard(arr)
        else:
            full = tuple((0, d) for d in arr.shape)
            shard = self._view(arr, 0, full, ViewGroup(arr))
        handles = self._insert([body.result_handle] if body.result_handle else [], [shard])
        return pb.FullyReplicatedShardResponse(array_handle=handles[0])

    @serves("result_handles")
    def _disassemble_into_single_device_arrays_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle)
        if len(arr.sharding.devices) == 1:
            shards = [self._shard(arr)]
        else:
            group = ViewGroup(arr)
            shards = [self._view(arr, i, r, group) for i, r in enumerate(t.shard_regions(arr.sharding, arr.shape))]
        handles = self._insert(list(body.result_handles), shards)
        return pb.DisassembleIntoSingleDeviceArraysResponse(array_handles=handles)

    @serves("result_handle")
    def _assemble_array_from_single_device_arrays_request(self, body: Any) -> Any:
        shape = t.shape_of(body.shape.dims)
        sharding = t.parse_sharding(body.sharding, len(self._table))
        shards = [self._array(h) for h in body.single_device_array_handles]
        dtype = t.dtype_of(body.dtype) if body.HasField("dtype") else None
        result = self._assemble(shape, dtype, sharding, shards)
        handles = self._insert([body.result_handle] if body.result_handle else [], [result])
        return pb.AssembleArrayFromSingleDeviceArraysResponse(array_handle=handles[0])

    def _assemble(self, shape: tuple[int, ...], dtype: Optional[np.dtype], sharding: Sharding,
                  shards: Sequence[IfrtArray]) -> IfrtArray:
        """The array of ``shape`` and ``dtype`` (None: the shards') laid out by ``sharding``
        whose shard i is ``shards[i]`` (single-device arrays, in the sharding's device order)."""
        if len(shards) != len(sharding.devices):
            raise t.invalid(f"{len(shards)} shards for a sharding of {len(sharding.devices)} devices")
        if dtype is None:  # a sharding has a device, so there is a shard
            dtype = shards[0].dtype
        regions = t.shard_regions(sharding, shape)
        groups = {id(s.group) for s in shards}
        parent = shards[0].group.parent if shards[0].group is not None else None
        if (parent is not None and len(groups) == 1 and parent.shape == shape and parent.error is None
                and not parent.deleted and set(parent.sharding.devices) == set(sharding.devices)
                and t.is_unreduced(parent.sharding.op) == t.is_unreduced(sharding.op)
                and all(s.region == r and s.sharding.devices == (d,)
                        for s, r, d in zip(shards, regions, sharding.devices))):
            # the views of one parent on all its devices, each the block the sharding gives
            # its device: every device holds what it held, so this is the parent's pathways
            # array under the new sharding (a new IFRT array, so that deleting one handle
            # leaves the other's reference to be dropped when it goes). Not across unreduced
            # and not: the layout says whether the devices' values are partial or replicas.
            return dataclasses.replace(parent, sharding=sharding)
        if math.prod(shape) * dtype.itemsize > self.buffers.limit:
            raise IfrtError(t.RESOURCE_EXHAUSTED, f"assembling a {dtype.name}{list(shape)} array from shards "
                                                  f"held apart needs more than {self.buffers.limit} bytes here")
        if t.is_unreduced(sharding.op):
            return self._put_partials(dtype, shape, sharding, {i: self._host_value(s) for i, s in enumerate(shards)})
        value = np.empty(shape, dtype)
        for s, region in zip(shards, regions):
            value[tuple(slice(a, b) for a, b in region)] = self._host_value(s)
        return self._put(value, sharding)

    @serves("result_handles")
    def _remap_arrays_request(self, body: Any) -> Any:
        """Shards of the input arrays regrouped into output arrays (``jax.device_put`` to a
        mesh of the same devices in another order uses it): each output is assembled from
        views of the inputs' shards, so one that keeps every device's block is the input's
        pathways array under the new sharding, with no copy."""
        plan = body.plan
        arrays = [self._array(h) for h in body.array_handles]
        if len(plan.input_specs) != len(arrays):
            raise t.invalid(f"the remap plan describes {len(plan.input_specs)} inputs; {len(arrays)} arrays given")
        for k, (arr, spec) in enumerate(zip(arrays, plan.input_specs)):
            if t.dtype_of(spec.dtype) != arr.dtype or t.shape_of(spec.shape.dims) != arr.shape:
                raise t.invalid(f"remap input {k} is a {arr.dtype.name}{list(arr.shape)} array, not the plan's "
                                f"{t.dtype_of(spec.dtype).name}{list(t.shape_of(spec.shape.dims))}")
        # an output's sharding; None for a ConcreteEvenSharding, whose blocks its shards give
        outs = [(t.shape_of(s.shape.dims), t.dtype_of(s.dtype), t.even_devices(s.sharding, len(self._table)),
                 s.sharding) for s in plan.output_specs]
        shardings = [None if even else t.parse_sharding(proto, len(self._table)) for _, _, even, proto in outs]
        counts = [len(even) if even else len(s.devices) for (_, _, even, _), s in zip(outs, shardings)]
        taken: list[list[Optional[tuple[int, int]]]] = [[None] * n for n in counts]  # (input, its shard)
        for mapping in plan.mappings:
            a, o = mapping.in_array, mapping.out_array
            if not (0 <= a < len(arrays) and 0 <= o < len(outs)):
                raise t.invalid(f"a remap mapping names input {a} and output {o} of {len(arrays)} and {len(outs)}")
            src = _shard_indices(mapping.from_start, mapping.from_end, mapping.from_step,
                                 len(arrays[a].sharding.devices))
            dst = _shard_indices(mapping.to_start, mapping.to_end, mapping.to_step, counts[o])
            if len(src) != len(dst):
                raise t.invalid(f"a remap mapping takes {len(src)} shards of input {a} to {len(dst)} of output {o}")
            for i, j in zip(src, dst):
                taken[o][j] = (a, i)
        views: dict[int, list[IfrtArray]] = {}  # input -> a view of each of its shards
        result = []
        for k, ((shape, dtype, even, _), sharding, given) in enumerate(zip(outs, shardings, taken)):
            pairs = [p for p in given if p is not None]
            if len(pairs) < len(given):
                missing = [j for j, p in enumerate(given) if p is None]
                raise t.invalid(f"the remap plan gives output {k} no shards {missing[:16]}")
            sources = {a for a, _ in pairs}
            for a in sources - set(views):
                arr, group = arrays[a], ViewGroup(arrays[a])
                views[a] = [self._view(arr, i, r, group)
                            for i, r in enumerate(t.shard_regions(arr.sharding, arr.shape))]
            if sharding is None:
                if len(sources) > 1 or arrays[pairs[0][0]].shape != shape:
                    raise IfrtError(t.UNIMPLEMENTED, f"remap output {k} (a ConcreteEvenSharding) gathers shards of "
                                                     f"inputs {sorted(sources)[:16]} into a {list(shape)} array; this "
                                                     "server remaps the shards of one array into one of its shape")
                sharding = t.relabelled(arrays[pairs[0][0]].sharding, even, [i for _, i in pairs])
            result.append(self._assemble(shape, dtype, sharding, [views[a][i] for a, i in pairs]))
        handles = self._insert(list(body.result_handles), result)
        if body.copy_semantics == types_pb2.ARRAY_COPY_SEMANTICS_DONATE_INPUT:
            for arr in arrays:  # after the outputs took their references to what they share
                self._delete(arr)
        return pb.RemapArraysResponse(array_handles=handles)

    # ---- copies between devices ------------------------------------------------------------------

    @serves("result_handles")
    def _copy_arrays_request(self, body: Any) -> Any:
        arrays = [self._array(h) for h in body.array_handles]
        out = []
        for arr in arrays:
            if body.device_ids and len(body.device_ids) != len(arr.sharding.devices):
                raise t.invalid(f"{len(body.device_ids)} destination devices for an array on "
                                f"{len(arr.sharding.devices)}")
            devices = tuple(body.device_ids) or arr.sharding.devices
            out.append(self._moved(arr, Sharding(devices, arr.sharding.op), body.copy_semantics))
        handles = self._insert(list(body.result_handles), out)
        return pb.CopyArraysResponse(array_handles=handles)

    @serves("result_handles")
    def _reshard_arrays_request(self, body: Any) -> Any:
        arrays = [self._array(h) for h in body.array_handles]
        if len(body.array_specs) != len(arrays):
            raise t.invalid(f"{len(body.array_specs)} array specs for {len(arrays)} arrays")
        out = []
        for arr, spec in zip(arrays, body.array_specs):
            if t.dtype_of(spec.dtype) != arr.dtype or t.shape_of(spec.shape.dims) != arr.shape:
                raise t.invalid("resharding keeps an array's dtype and shape")
            out.append(self._moved(arr, t.parse_sharding(spec.sharding, len(self._table)), body.copy_semantics))
        handles = self._insert(list(body.result_handles), out)
        return pb.ReshardArraysResponse(array_handles=handles)

    def _moved(self, arr: IfrtArray, sharding: Sharding, semantics: int) -> IfrtArray:
        """``arr`` laid out by ``sharding``: when nothing changes, a new IFRT array naming
        the same pathways array (not ``arr`` itself: the client deletes and destructs each
        of its handles, and the data must go once both have gone, whichever is deleted
        first), else a run of an identity function defined on the destination layout (the
        data plane moves it)."""
        if sharding == arr.sharding:
            return dataclasses.replace(arr)
        spans = len(self._table.islands(sharding.devices)) > 1
        if arr.parts or spans:
            return self._moved_across(arr, sharding, semantics, spans)
        arr = self._real(arr)
        place, layout = self._table.layout(sharding, len(arr.shape))
        program = self._identity(arr.dtype, arr.shape, layout, place)
        base = self.native.allocate(2)
        self.native.submit(program, base, {0: arr.handle}, "copy")
        if semantics == types_pb2.ARRAY_COPY_SEMANTICS_DONATE_INPUT:
            self._delete(arr)
        return IfrtArray(arr.dtype, arr.shape, sharding, base + 1, layout, place)

    def _moved_across(self, arr: IfrtArray, sharding: Sharding, semantics: int, spans: bool) -> IfrtArray:
        """A move from or to a layout across islands. An island part holding the whole
        array moves to one island as any array does; else the parts are assembled here
        and put where they go (as the shards of views are)."""
        full = tuple((0, d) for d in arr.shape)
        whole = [p for box, p in arr.parts if box == full]
        if whole and not spans:
            out = self._moved(whole[0], sharding, types_pb2.ARRAY_COPY_SEMANTICS_ALWAYS_COPY)
        else:
            if math.prod(arr.shape) * arr.dtype.itemsize > self.buffers.limit:
                raise IfrtError(t.RESOURCE_EXHAUSTED, f"moving a {arr.dtype.name}{list(arr.shape)} array laid out "
                                                      f"across islands needs more than {self.buffers.limit} bytes "
                                                      "here; move it in smaller arrays")
            out = self._put(self._host_value(arr), sharding)
        if semantics == types_pb2.ARRAY_COPY_SEMANTICS_DONATE_INPUT:
            self._delete(arr)
        return out

    def _identity(self, dtype: np.dtype, shape: tuple[int, ...], layout: Layout, place: SliceDevices) -> int:
        key = (dtype.name, shape, layout)
        program = self._identities.get(key)
        if program is not None:
            return program
        import jax  # the export needs JAX; only copies do
        from jax.sharding import NamedSharding, PartitionSpec

        from pathways.client.compiled import abstract_mesh

        s = NamedSharding(abstract_mesh(layout.mesh_shape, layout.axis_names), PartitionSpec(*layout.spec))
        # as every pathways function: positional arguments in, a list of outputs out; with
        # 64-bit types on, so that a client's int64 or float64 array is copied as it is (the
        # client typed it; this process's JAX must not narrow it)
        try:
            with jax.enable_x64(True):
                exported = jax.export.export(jax.jit(lambda x: [x], in_shardings=[s], out_shardings=[s]),
                                             platforms=export_platforms(place.slice.kind))(
                    jax.ShapeDtypeStruct(shape, dtype, sharding=s))
        except Exception as e:
            raise IfrtError(t.INTERNAL, f"no copy function for a {dtype.name}{list(shape)} array: {e}") from None
        fn = define_function(self.native, place.slice.id, "copy", exported, (layout,), (layout,))
        graph = ProgramGraph(2, (0,), (Node(fn, (0,), (1,)),), (1,), value_types([(shape, dtype)] * 2))
        program = register_program(self.native, graph, {}, {}).program_id
        self._identities[key] = program
        return program


def _shard_indices(starts: Sequence[int], ends: Sequence[int], steps: Sequence[int], n: int) -> list[int]:
    """The shard indices a remap mapping's intervals ([start, end) by step) name, each below ``n``."""
    if not len(starts) == len(ends) == len(steps):
        raise t.invalid("a remap interval lacks its start, end or step")
    out: list[int] = []
    for start, end, step in zip(starts, ends, steps):
        if step < 1 or not (0 <= start and end <= n):
            raise t.invalid(f"remap interval [{start}, {end}) by {step} is not within the {n} shards of its array")
        out.extend(range(start, end, step))
        if len(out) > n:
            raise t.invalid(f"remap intervals name more than the {n} shards of their array")
    return out
