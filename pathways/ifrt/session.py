"""One IFRT proxy session, translated into one native pathways client session.

Arrays live on the workers: an IFRT array handle maps to a pathways handle, its Layout,
dtype and shape. Puts go straight to the workers (``Session.put``), reads come straight
from them (``Session.fetch``), an executable is an "xla" function of the session's slice
on its island run as a one-node program, and a copy to other devices (maybe of another
island) is a run of an identity function defined on the destination layout, so the
bytes move worker to worker. An array laid out over devices of several islands (which
share no interconnect) is held as one pathways array per island, each the box of the
array that island's devices hold, laid out by the island's part of the sharding: it can
be put, read, cut into shards and moved, but no computation takes it as is.

Each handler (``REQUESTS``: one entry per request kind served, registered by ``serves``,
handling.py) takes the request's body and returns the response's body, or a ``Deferred``
when it must wait (a fetch, a compile, a ready check): the server runs those on a
bounded pool, so that one slow request does not hold up the session's others. Handlers
run in request order; every wait is bounded by ``handling.WAIT_SECONDS``.

The handlers are grouped by what they touch, each group a base class of IfrtSession in a
module of its own working on its state: the native operations they are made of
(native_ops.py), host buffers in and out (host_arrays.py), shards, views and copies
(views.py), executables (executing.py); this module keeps the session, its handle
tables, futures, deletion and defaults.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from pathways import errors
from pathways.client.session import Session
from pathways.ifrt import types as t
from pathways.ifrt.devices import DeviceTable, SliceInfo
from pathways.ifrt.executing import Executing
from pathways.ifrt.handling import (DONE, MAX_ARRAYS, REQUESTS, SLICE_KEY, Deferred, IfrtArray, IfrtExecutable, Lazy,
                                    attributes, failed_future, serves, shard_of_deleted)
from pathways.ifrt.host_arrays import HostArrays
from pathways.ifrt.host_buffers import HostBuffers
from pathways.ifrt.native_ops import NativeOps
from pathways.ifrt.colocated import ColocatedProgram, ColocatedPython
from pathways.ifrt.persistence import PersistenceProgram, Persisting
from pathways.ifrt.profiling import ProfileProgram, ProfilingHosts
from pathways.ifrt.types import IfrtError
from pathways.ifrt.views import Views
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.platforms import export_platforms
from pathways.protocol import messages as m
from pathways.protocol.handles import HeldReleases

log = logging.getLogger("pathways.ifrt")


class IfrtSession(NativeOps, HostArrays, Views, Executing, Persisting, ColocatedPython, ProfilingHosts):
    """``native``: the pathways session this IFRT session acts through (closed with it)."""

    def __init__(self, native: Session, session_id: int, init_data: dict[str, Any],
                 buffers: Optional[HostBuffers] = None) -> None:
        self.native = native
        self.id = session_id
        self.init_data = init_data
        self.buffers = buffers or HostBuffers()
        self.devices: Optional[DeviceTable] = None
        self._arrays: dict[int, IfrtArray] = {}
        self._executables: dict[int, IfrtExecutable | PersistenceProgram | ColocatedProgram | ProfileProgram] = {}
        self._futures: dict[int, Lazy] = {}
        self._refs: dict[int, int] = {}  # pathways handle -> IFRT arrays naming it
        # An array's views (its shards, which read its data, and the shards of a
        # single-device array, which are it): id of the array -> how many the client holds,
        # and the ids of arrays it dropped while views of them lived (their data goes with
        # the last view). A deleted array's data goes at once.
        self._views: dict[int, int] = {}
        self._orphans: set[int] = set()
        self._reading: HeldReleases[None] = HeldReleases()  # reads in flight: a handle's release waits for them
        self._lock = threading.Lock()
        self._server_handles = itertools.count(t.SERVER_HANDLE_BASE)
        self._identities: dict[tuple, int] = {}  # (dtype, shape, layout) -> identity program id

    # ---- plumbing ------------------------------------------------------------------------

    def handle(self, kind: str, body: Any) -> Any:
        """The response body for request ``kind``, or a Deferred; IfrtError on failure."""
        served = REQUESTS.get(kind)
        if served is None:
            raise IfrtError(t.UNIMPLEMENTED, f"{kind} is not implemented by the pathways IFRT server")
        if kind != "init_request" and self.devices is None:
            raise IfrtError(t.FAILED_PRECONDITION, f"{kind} before init_request; a session starts with init")
        return served.handler(self, body)

    def fail_handles(self, kind: str, body: Any, error: IfrtError) -> None:
        """A request that names handles for its results failed: those handles now hold
        the error, so that whoever reads them learns why (as the reference server does)."""
        served = REQUESTS.get(kind)
        if served is not None:
            field_name = served.result_handles
        else:  # a kind not served here: its result handles by the protocol's name for them
            field_name = next((f for f in ("result_handles", "result_handle") if f in body.DESCRIPTOR.fields_by_name),
                              None)
        if field_name is None:
            return
        value = getattr(body, field_name)
        handles = [value] if isinstance(value, int) else list(value)
        for h in handles:
            if h and h not in self._arrays and len(self._arrays) < MAX_ARRAYS:
                self._arrays[h] = IfrtArray(np.dtype("float32"), (), t.replicated((0,)), error=error)
        if kind == "loaded_executable_execute_request" and body.result_status_handle:
            self._futures.setdefault(body.result_status_handle, failed_future(error))

    def close(self, reason: str) -> None:
        self.buffers.close(reason)
        self.native.close()  # the controller frees every array and function of the session

    def _server_handle(self) -> int:
        return next(self._server_handles)

    def _array(self, handle: int, usable: bool = True) -> IfrtArray:
        arr = self._arrays.get(handle)
        if arr is None:
            raise IfrtError(t.NOT_FOUND, f"unknown array handle {handle}")
        if usable:
            if arr.error is not None:
                raise arr.error
            if arr.deleted:
                raise IfrtError(t.FAILED_PRECONDITION, f"array {handle} was deleted")
            if arr.alias_of is not None and arr.alias_of.deleted:
                raise shard_of_deleted()
        return arr

    def _insert(self, handles: Sequence[int], arrays: Sequence[IfrtArray]) -> list[int]:
        """Name ``arrays`` by the client's ``handles`` (or new server handles when none)."""
        if handles and len(handles) != len(arrays):
            raise t.invalid(f"{len(handles)} result handles given for {len(arrays)} arrays")
        handles = list(handles) or [self._server_handle() for _ in arrays]
        if len(self._arrays) + len(handles) > MAX_ARRAYS:
            raise IfrtError(t.RESOURCE_EXHAUSTED, f"this session holds {len(self._arrays)} arrays, the most "
                                                  f"allowed is {MAX_ARRAYS}; delete arrays you no longer use")
        for h in handles:
            if h == 0 or h in self._arrays:
                raise t.invalid(f"array handle {h} is {'zero' if h == 0 else 'already in use'}")
        for h, arr in zip(handles, arrays):
            self._arrays[h] = arr
            self._retain(arr)
        return handles

    def _retain(self, arr: IfrtArray) -> None:
        with self._lock:
            owner = _owner(arr)
            if owner is not None:
                parent = id(owner)
                self._views[parent] = self._views.get(parent, 0) + 1
                return
            for handle in arr.handles:
                self._refs[handle] = self._refs.get(handle, 0) + 1

    def _drop(self, arr: IfrtArray, deleted: bool = False) -> None:
        """An IFRT array stops naming its pathways handles; the last one frees each. An
        array dropped while views of it live keeps them until the last view goes, unless
        it was ``deleted`` (then its views can no longer be read)."""
        doomed = []
        with self._lock:
            owner = _owner(arr)
            if owner is not None:
                parent = id(owner)
                left = self._views.get(parent, 1) - 1
                if left > 0:
                    self._views[parent] = left
                    return
                self._views.pop(parent, None)
                if parent not in self._orphans:
                    return
                self._orphans.discard(parent)
                arr = owner  # dropped before its last view: its data goes now
            elif not deleted and self._views.get(id(arr)):
                self._orphans.add(id(arr))
                return
            for handle in arr.handles:
                left = self._refs.get(handle, 1) - 1
                if left > 0:
                    self._refs[handle] = left
                    continue
                self._refs.pop(handle, None)
                if self._reading.release(handle, None):  # else released when the read finishes
                    doomed.append(handle)
        for handle in doomed:
            self.native.release(handle)

    def _reads(self, handles: Sequence[int]) -> Callable[[], None]:
        """Hold back the release of ``handles`` until the returned callable is called."""
        with self._lock:
            self._reading.reading(handles)

        def done() -> None:
            with self._lock:
                doomed = self._reading.read_done(handles)
            for h in doomed:
                self.native.release(h)
        return done

    # ---- session ------------------------------------------------------------------------------

    @serves()
    def _init_request(self, body: pb.InitRequest) -> pb.InitResponse:
        if self.devices is not None:
            raise IfrtError(t.FAILED_PRECONDITION, "init_request was sent twice in one session")
        self.devices = DeviceTable(self.slices())
        self.native.slices.update(self.devices.movers)  # an island that heals: its new addresses
        kinds = {d.kind for d in self.devices.devices}
        platform = export_platforms(sorted(kinds)[0])[0] if kinds else "cpu"
        resp = pb.InitResponse(session_id=self.id, platform_name=platform, platform_version="pathways",
                               platform_id=0, process_index=0, runtime_type="pathways")
        for d in self.devices.devices:
            dev = resp.all_devices.add(id=d.id, local_device_id=d.id, local_hardware_id=d.id, platform_name=platform,
                                       device_kind=d.kind, default_memory_id=d.id, memory_ids=[d.id],
                                       debug_string=f"{d.kind}:{d.id}",
                                       to_string=(f"PathwaysDevice(id={d.id}, kind={d.kind}, island={d.island}, "
                                                  f"host={d.rank}, index={d.index})"))
            # slice_index: the island, under the name Pathways tooling groups devices into slices by
            attributes(dev.attributes, {"island": d.island, "slice_index": d.island, "host": d.rank,
                                        "worker": d.worker, "index": d.index, "kind": d.kind})
            resp.addressable_device_ids.append(d.id)
            resp.primary_device_ids.append(d.id)
            resp.memories.add(id=d.id, memory_space_kind=t.MEMORY_KIND, kind_id=0, device_ids=[d.id],
                              debug_string=f"{t.MEMORY_KIND}:{d.id}", to_string=f"Memory(id={d.id}, kind=device)")
        attributes(resp.client_attributes, {})
        return resp

    def slices(self) -> list[SliceInfo]:
        """The slices of this session's devices, placed now: the one PATHWAYS_SLICE asks
        for, else one per healthy island; IfrtError where there is none."""
        asked = self.init_data.get(SLICE_KEY)
        if asked is not None:
            kind, count, island = parse_slice(asked)
            return [self._slice(kind, count, island)]
        status = self.native.cluster()
        slices = []
        for isl in status.get("islands", []):
            if not isl.get("healthy") or not isl.get("devices"):
                continue
            kinds = {w["kind"] for w in status.get("workers", []) if w.get("island") == isl["island"]}
            if len(kinds) != 1:
                continue
            slices.append(self._slice(kinds.pop(), isl["devices"], isl["island"]))
        if not slices:
            raise IfrtError(t.UNAVAILABLE, "the cluster has no healthy island; `python -m pathways status` shows why")
        return slices

    def _slice(self, kind: str, count: int, island: Optional[int]) -> SliceInfo:
        try:
            reply = self.native.request(lambda req: m.SliceRequest(req, kind, count, None, island, False))
        except errors.PathwaysError as e:
            raise IfrtError(t.UNAVAILABLE, f"no slice of {count} {kind} device(s)"
                                           f"{'' if island is None else f' on island {island}'}: {e}") from None
        flat = reply.devices
        return SliceInfo(reply.slice, kind, reply.island, tuple(reply.workers), tuple(reply.addresses),
                         tuple(zip(flat[::2], flat[1::2])))

    # ---- futures and readiness --------------------------------------------------------------

    @serves()
    def _check_future_request(self, body: pb.CheckFutureRequest) -> Deferred:
        return self._future_done(body.future_handle, "future handle", pb.CheckFutureResponse)

    @serves()
    def _loaded_executable_fetch_execute_result_request(self, body: Any) -> Deferred:
        return self._future_done(body.result_status_handle, "result status handle",
                                 pb.LoadedExecutableFetchExecuteResultResponse)

    def _future_done(self, handle: int, what: str, response: Callable[[], Any]) -> Deferred:
        """Wait for status future ``handle`` (checked once: it is forgotten), then answer
        with an empty ``response``; ``what`` names the handle in the error."""
        future = self._futures.pop(handle, None)
        if future is None:
            raise IfrtError(t.NOT_FOUND, f"unknown {what} {handle}")

        def run() -> Any:
            future.result()
            return response()
        return Deferred(run)

    @serves()
    def _check_value_ready_request(self, body: pb.CheckValueReadyRequest) -> Deferred:
        arrays = [self._array(h) for h in body.value_handles]
        done = self._reads([h for a in arrays for h in (a.group.parent if a.group is not None else a).handles])

        def run() -> pb.CheckValueReadyResponse:
            try:
                self._wait_ready(arrays)
            finally:
                done()
            return pb.CheckValueReadyResponse()
        return Deferred(run)

    # ---- deletion ----------------------------------------------------------------------------------

    def _delete(self, arr: IfrtArray) -> None:
        if not arr.deleted:
            arr.deleted = True
            self._drop(arr, deleted=True)

    @serves()
    def _delete_array_request(self, body: Any) -> Any:
        missing = [h for h in body.array_handle if h not in self._arrays]
        for h in body.array_handle:
            if h in self._arrays:
                self._delete(self._arrays[h])
        handle = self._server_handle()
        self._futures[handle] = (failed_future(IfrtError(t.NOT_FOUND, f"unknown array handle(s) {missing[:16]}"))
                                 if missing else DONE)
        return pb.DeleteArrayResponse(deletion_future_handle=handle)

    @serves()
    def _is_array_deleted_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle, usable=False)
        return pb.IsArrayDeletedResponse(deleted=arr.deleted or (arr.alias_of is not None and arr.alias_of.deleted))

    @serves()
    def _destruct_array_request(self, body: Any) -> Any:
        missing = []
        for h in body.array_handle:
            arr = self._arrays.pop(h, None)
            if arr is None:
                missing.append(h)
            elif not arr.deleted:
                self._drop(arr)
        if missing:
            raise IfrtError(t.NOT_FOUND, f"unknown array handle(s) {missing[:16]}")
        return pb.DestructArrayResponse()

    # ---- defaults -------------------------------------------------------------------------------

    @serves()
    def _get_default_layout_request(self, body: Any) -> Any:
        t.dtype_of(body.dtype)
        self._table.get(body.device_id)
        return pb.GetDefaultLayoutResponse(serialized_pjrt_layout=t.default_layout_text(len(body.dims)))

    @serves()
    def _get_default_device_assignment_request(self, body: Any) -> Any:
        replicas, partitions = body.num_replicas, body.num_partitions
        if not (0 < replicas and 0 < partitions and replicas * partitions <= len(self._table)):
            raise t.invalid(f"a device assignment of {replicas} replicas x {partitions} partitions does not fit "
                            f"this session's {len(self._table)} devices")
        resp = pb.GetDefaultDeviceAssignmentResponse()
        da = resp.device_assignment
        da.replica_count, da.computation_count = replicas, partitions
        for p in range(partitions):
            da.computation_devices.add(replica_device_ids=[r * partitions + p for r in range(replicas)])
        return resp

    @property
    def _table(self) -> DeviceTable:
        assert self.devices is not None
        return self.devices


def parse_slice(text: Any) -> tuple[str, int, Optional[int]]:
    """``KIND:COUNT[@ISLAND]`` (PATHWAYS_SLICE) -> (kind, count, island or None)."""
    advice = "PATHWAYS_SLICE must read KIND:COUNT or KIND:COUNT@ISLAND, e.g. cpu:2 or cpu:2@1"
    if not isinstance(text, str) or len(text) > 64:
        raise t.invalid(advice)
    spec, _, island = text.partition("@")
    kind, _, count = spec.partition(":")
    if kind not in m.DEVICE_KINDS or not count.isdigit() or int(count) < 1 or (island and not island.isdigit()):
        raise t.invalid(f"{advice}; got {text!r}")
    return kind, int(count), int(island) if island else None


def _owner(arr: IfrtArray) -> Optional[IfrtArray]:
    """The array whose data ``arr``, a view or a single-device array's shard, reads
    without a reference of its own; None for an array holding its own."""
    return arr.group.parent if arr.group is not None else arr.alias_of
