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

Each handler (``REQUESTS``: one entry per request kind served, registered by ``_serves``)
takes the request's body and returns the response's body, or a ``Deferred``
when it must wait (a fetch, a compile, a ready check): the server runs those on a
bounded pool, so that one slow request does not hold up the session's others. Handlers
run in request order; every wait is bounded by ``WAIT_SECONDS``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from pathways import errors
from pathways.client.compiled import define_function, register_program, value_types
from pathways.client.fetches import Sink
from pathways.client.session import Session
from pathways.ifrt import types as t
from pathways.ifrt.devices import DeviceTable, SliceDevices, SliceInfo
from pathways.ifrt.host_buffers import HostBuffer, HostBuffers
from pathways.proto.xla import xla_data_pb2
from pathways.proto.xla.pjrt.proto import executable_metadata_pb2
from pathways.proto.xla.python.ifrt import attribute_map_pb2
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.proto.xla.python.ifrt_proxy.common import types_pb2
from pathways.proto.xla.python.pjrt_ifrt import xla_compiler_pb2
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Layout, Node, ProgramGraph, device_regions, evenly_divided, host_regions, partials, stacked
from pathways.platforms import export_platforms
from pathways.protocol import messages as m
from pathways.protocol.handles import HeldReleases
from pathways.timeline import function_label, now
from pathways.wire import codec
from pathways.wire.codec import dtype_of_name

log = logging.getLogger("pathways.ifrt")

WAIT_SECONDS = 600.0  # the longest any request waits: a fetch, a compile, a ready check
HOST_BUFFER_WAIT = 60.0  # for a host buffer whose HostBufferStore call has not arrived yet, or its next bytes
# Host buffers larger than this go to their worker chunk by chunk as they arrive (when one
# worker holds the array whole); smaller ones in one message once whole.
STREAMED_PUT_BYTES = 1 << 20
MAX_ARRAYS = 1 << 20  # live IFRT handles per session
XLA_PROGRAM = "xla::ifrt::XlaProgram"
XLA_COMPILE_OPTIONS = "xla::ifrt::XlaCompileOptions"
SLICE_KEY = "pathways_slice"


_Handler = Callable[["IfrtSession", Any], Any]  # (session, the request's body) -> the response's body, or a Deferred


@dataclass(frozen=True)
class RequestKind:
    """How the session serves one kind of IFRT request."""

    handler: _Handler
    result_handles: Optional[str] = None  # the field of the request naming the handles of the arrays it makes


# request kind (the IfrtRequest field, "..._request") -> how it is served: every kind the
# session serves, each registered by ``_serves`` on its handler ``IfrtSession._<kind>``
REQUESTS: dict[str, RequestKind] = {}


def _serves(result_handles: Optional[str] = None) -> Callable[[_Handler], _Handler]:
    """Register method ``_<kind>`` as the handler of request ``kind``; ``result_handles``:
    the field of the request that names the handles of the arrays it makes (they hold the
    error when the request fails)."""
    def register(handler: _Handler) -> _Handler:
        REQUESTS[handler.__name__[1:]] = RequestKind(handler, result_handles)
        return handler
    return register


class Deferred:
    """Work that waits: run on the server's pool, its result (a response body) sent when
    done. With ``answer``: that response body is sent at once and the work runs after it
    (its result is not sent: the work reports its own failures)."""

    def __init__(self, run: Callable[[], Any], answer: Any = None) -> None:
        self.run = run
        self.answer = answer


class Lazy:
    """A status future the client checks at most once: ``wait`` runs only when asked."""

    def __init__(self, wait: Callable[[], None], on_done: Callable[[], None] = lambda: None) -> None:
        self._wait, self._on_done = wait, on_done

    def result(self) -> None:
        try:
            self._wait()
        finally:
            self._on_done()


def _failed(error: IfrtError) -> Lazy:
    def wait() -> None:
        raise error
    return Lazy(wait)


_DONE = Lazy(lambda: None)


@dataclass
class _Group:
    """Views of one parent array (its shards): the parent is fetched once for all of them."""

    parent: "_Array"
    lock: threading.Lock = field(default_factory=threading.Lock)
    value: Optional[np.ndarray] = None


@dataclass
class _Array:
    dtype: np.dtype
    shape: tuple[int, ...]
    sharding: Sharding
    handle: Optional[int] = None  # the pathways handle; None for a view or an error
    layout: Optional[Layout] = None
    place: Optional[SliceDevices] = None
    group: Optional[_Group] = None  # set for a view: the block ``region`` of group.parent
    region: Optional[t.Region] = None
    error: Optional[IfrtError] = None
    deleted: bool = False
    token: bool = False  # an executable's token output: it has no data to read
    # set for an array laid out across islands: each island's box of it and the array on
    # that island holding the box (handle, layout and place stay None)
    parts: tuple[tuple[t.Region, "_Array"], ...] = ()
    # set for the shard of a single-device array (FullyReplicatedShard, Disassemble...): the
    # array it is, whose pathways handle it names without a reference of its own, as a
    # view does (see IfrtSession._shard)
    alias_of: Optional["_Array"] = None

    @property
    def handles(self) -> list[int]:
        """The pathways handles holding this array's data (none for a view or an error)."""
        if self.handle is not None:
            return [self.handle]
        return [p.handle for _, p in self.parts if p.handle is not None]


@dataclass
class _Executable:
    fn: int
    compiled: Any  # m.Compiled
    devices: tuple[int, ...]  # IFRT ids, in device-assignment order
    place: SliceDevices
    label: str  # what the timeline names its runs by (timeline.function_label)
    program: Optional[int] = None
    in_types: tuple[tuple[np.dtype, tuple[int, ...]], ...] = ()  # its program's arguments
    # each output's dtype, shape, sharding, layout, place and whether it is a token, the same
    # for every run
    outputs: tuple[tuple[np.dtype, tuple[int, ...], Sharding, Layout, SliceDevices, bool], ...] = ()


class IfrtSession:
    """``native``: the pathways session this IFRT session acts through (closed with it)."""

    def __init__(self, native: Session, session_id: int, init_data: dict[str, Any],
                 buffers: Optional[HostBuffers] = None) -> None:
        self.native = native
        self.id = session_id
        self.init_data = init_data
        self.buffers = buffers or HostBuffers()
        self.devices: Optional[DeviceTable] = None
        self._arrays: dict[int, _Array] = {}
        self._executables: dict[int, _Executable] = {}
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
                self._arrays[h] = _Array(np.dtype("float32"), (), t.replicated((0,)), error=error)
        if kind == "loaded_executable_execute_request" and body.result_status_handle:
            self._futures.setdefault(body.result_status_handle, _failed(error))

    def close(self, reason: str) -> None:
        self.buffers.close(reason)
        self.native.close()  # the controller frees every array and function of the session

    def _server_handle(self) -> int:
        return next(self._server_handles)

    def _array(self, handle: int, usable: bool = True) -> _Array:
        arr = self._arrays.get(handle)
        if arr is None:
            raise IfrtError(t.NOT_FOUND, f"unknown array handle {handle}")
        if usable:
            if arr.error is not None:
                raise arr.error
            if arr.deleted:
                raise IfrtError(t.FAILED_PRECONDITION, f"array {handle} was deleted")
            if arr.alias_of is not None and arr.alias_of.deleted:
                raise _shard_of_deleted()
        return arr

    def _insert(self, handles: Sequence[int], arrays: Sequence[_Array]) -> list[int]:
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

    def _retain(self, arr: _Array) -> None:
        with self._lock:
            owner = _owner(arr)
            if owner is not None:
                parent = id(owner)
                self._views[parent] = self._views.get(parent, 0) + 1
                return
            for handle in arr.handles:
                self._refs[handle] = self._refs.get(handle, 0) + 1

    def _drop(self, arr: _Array, deleted: bool = False) -> None:
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

    # ---- native operations -----------------------------------------------------------------

    def _put(self, value: np.ndarray, sharding: Sharding) -> _Array:
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
                sharding: Sharding) -> _Array:
        """An array of ``shape`` put on ``place`` laid out by ``layout``: ``value``, or for an
        unreduced layout the stack of its partial values."""
        handle = self.native.allocate(1)
        moves = self.native.moves  # before the addresses: a move in between makes the controller drop the put
        self.native.put(place.addresses, handle, layout, value, moves)
        return _Array(value.dtype, shape, sharding, handle, layout, place)

    def _put_partials(self, dtype: np.dtype, shape: tuple[int, ...], sharding: Sharding,
                      own: dict[int, np.ndarray]) -> _Array:
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

    def _put_parts(self, value: np.ndarray, sharding: Sharding, islands: list[list[int]]) -> _Array:
        """``value`` laid out across islands: each island's box of it put on that island."""
        shape = tuple(value.shape)
        cuts = [t.island_part(sharding, shape, positions) for positions in islands]  # all checked before any put
        parts: list[tuple[t.Region, _Array]] = []
        try:
            for box, part in cuts:
                parts.append((box, self._put(value[tuple(slice(a, b) for a, b in box)], part)))
        except BaseException:
            for _, arr in parts:
                self.native.release(arr.handle)
            raise
        return _Array(value.dtype, shape, sharding, parts=tuple(parts))

    @staticmethod
    def _addresses(arr: _Array, rank: Optional[int] = None) -> tuple[str, ...]:
        """The workers a read of ``arr`` asks, where they are now (with ``rank``: the host
        of that island rank alone)."""
        place = arr.place
        assert place is not None
        if rank is not None:
            return (place.addresses[place.workers.index(place.workers_by_rank[rank])],)
        return place.addresses[:1] if arr.sharding.replicated else place.addresses

    def _fetch(self, arr: _Array, data: bool, device: Optional[int] = None, sink: Optional[Sink] = None) -> Any:
        """The array's value (``data``) or its readiness, from the workers; bounded. With
        ``device`` (an IFRT id): the buffer of that device of the array alone. With ``sink``:
        each worker's reply goes there as it arrives (Session.fetch)."""
        assert arr.handle is not None and arr.place is not None
        pair = None
        if device is not None:
            d = self._table.get(device)
            pair = (d.rank, d.index)
        addresses = functools.partial(self._addresses, arr, None if pair is None else pair[0])
        try:
            value = self.native.fetch(addresses, arr.handle, WAIT_SECONDS, data, pair, sink)
        except errors.PathwaysError as e:
            raise t.runtime_failure(e) from None
        if value is None:
            raise IfrtError(t.DEADLINE_EXCEEDED, f"the array was not computed within {WAIT_SECONDS:g} s")
        return value

    def _host_value(self, arr: _Array) -> np.ndarray:
        if arr.error is not None:
            raise arr.error
        if arr.parts:
            return self._assembled(arr)
        if arr.group is None:
            return self._fetch(arr, data=True)
        group = arr.group
        assert arr.region is not None
        parent = group.parent
        if parent.deleted and group.value is None:
            raise _shard_of_deleted()
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
        return value[tuple(slice(a, b) for a, b in arr.region)]

    def _assembled(self, arr: _Array) -> np.ndarray:
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

    def _real(self, arr: _Array) -> _Array:
        """``arr`` as an array on the workers: a view is made one (its shard is put)."""
        if arr.group is None:
            return arr
        real = self._put(np.ascontiguousarray(self._host_value(arr)), arr.sharding)
        self._drop(arr)  # no longer a view
        arr.handle, arr.layout, arr.place, arr.group, arr.region = real.handle, real.layout, real.place, None, None
        self._retain(arr)
        return arr

    def _wait_ready(self, arrays: Sequence[_Array]) -> None:
        for arr in arrays:
            if arr.error is not None:
                raise arr.error
            target = arr.group.parent if arr.group is not None else arr
            if target.error is not None:
                raise target.error
            if target.deleted and target is not arr:
                raise _shard_of_deleted()
            for part in [p for _, p in target.parts] or [target]:
                self._fetch(part, data=False)

    # ---- session ------------------------------------------------------------------------------

    @_serves()
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
            _attributes(dev.attributes, {"island": d.island, "slice_index": d.island, "host": d.rank,
                                         "worker": d.worker, "index": d.index, "kind": d.kind})
            resp.addressable_device_ids.append(d.id)
            resp.primary_device_ids.append(d.id)
            resp.memories.add(id=d.id, memory_space_kind=t.MEMORY_KIND, kind_id=0, device_ids=[d.id],
                              debug_string=f"{t.MEMORY_KIND}:{d.id}", to_string=f"Memory(id={d.id}, kind=device)")
        _attributes(resp.client_attributes, {})
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

    @_serves()
    def _check_future_request(self, body: pb.CheckFutureRequest) -> Deferred:
        return self._future_done(body.future_handle, "future handle", pb.CheckFutureResponse)

    @_serves()
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

    @_serves()
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

    # ---- arrays from and to the host -----------------------------------------------------------

    def _host_array(self, handle: int, dtype: np.dtype, shape: tuple[int, ...], strides: Optional[list[int]]) -> np.ndarray:
        # taken: the put keeps the bytes alive as long as it needs them
        try:
            buffer = self.buffers.get(handle, 0.0, take=True)
        except IfrtError:  # not stored yet: what the server holds back (runs) must not wait for it
            self.native.send_held()
            buffer = self.buffers.get(handle, HOST_BUFFER_WAIT, take=True)
        return t.host_view(buffer, dtype, shape, strides)

    @_serves("array_handle")
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

    @_serves("array_handles")
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

    @_serves("array_handles")
    def _make_error_arrays_request(self, body: Any) -> Any:
        error = IfrtError(body.error.code or t.INTERNAL, body.error.message[:4096])
        arrays = [_Array(t.dtype_of(s.dtype), t.shape_of(s.shape.dims),
                         t.parse_sharding(s.sharding, len(self._table)), error=error) for s in body.array_specs]
        return pb.MakeErrorArraysResponse(array_handles=self._insert(list(body.array_handles), arrays))

    def _put_blocks(self, dtype: np.dtype, shape: tuple[int, ...], sharding: Sharding,
                    blocks: dict[t.Region, np.ndarray]) -> _Array:
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
            return _Array(dtype, shape, sharding, handle, layout, place)
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
                      sharding: Sharding) -> Optional[_Array]:
        """The array of host buffer ``handle`` put on its worker chunk by chunk as the
        buffer arrives, without waiting for it; None where it goes whole (small, strided,
        unreduced, or not held whole by one worker)."""
        assert self.devices is not None
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= STREAMED_PUT_BYTES or not t.c_contiguous(dtype, shape, strides):
            return None
        if len(self.devices.islands(sharding.devices)) > 1:
            return None
        place, layout = self.devices.layout(sharding, len(shape))
        if len(layout.workers) != 1 or layout.unreduced:
            return None
        pw_handle = self.native.allocate(1)
        moves = self.native.moves  # before the address: a move in between makes the controller drop the put
        chunks = _exactly(nbytes, f"a {dtype.name}{list(shape)} array", self.buffers.chunks(handle, HOST_BUFFER_WAIT,
                                                                                           take=True))
        self.native.put_chunks(place.addresses[0], pw_handle, layout, dtype, shape, chunks, moves)
        return _Array(dtype, shape, sharding, pw_handle, layout, place)

    @_serves()
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
                if (arr.group is None and not arr.parts and t.c_contiguous(arr.dtype, arr.shape, strides)
                        and len(self._addresses(arr)) == 1):
                    self._fetch(arr, data=True, sink=lambda header, chunks: self._receive(buffer, arr, header, chunks))
                else:
                    self.buffers.add(buffer, memoryview(t.strided_bytes(self._host_value(arr), strides)))
                self.buffers.finish(buffer)
            except Exception as e:
                self.buffers.fail(buffer, e if isinstance(e, IfrtError) else t.runtime_failure(e))
            finally:
                done()
        return Deferred(run, answer=pb.CopyToHostBufferResponse())

    def _receive(self, buffer: HostBuffer, arr: _Array, header: dict, chunks: Iterator[bytes]) -> None:
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

    # ---- shards and views ------------------------------------------------------------------------

    def _view(self, arr: _Array, index: int, region: t.Region, group: Optional[_Group]) -> _Array:
        device = arr.sharding.devices[index]
        if arr.group is not None:  # a view of a view: the same parent, a block of its block
            base = arr.region or ()
            region = tuple((o + a, o + b) for (o, _), (a, b) in zip(base, region))
            group = arr.group
        return _Array(arr.dtype, tuple(b - a for a, b in region), t.replicated((device,)), group=group,
                      region=region)

    @staticmethod
    def _shard(arr: _Array) -> _Array:
        """The one shard of single-device array ``arr``: a new IFRT array that is ``arr``, as
        a view of it. JAX keeps it as ``arr``'s cached shard (np.asarray reads it, and
        x.addressable_shards hands it out) and, on x.delete(), deletes ``arr`` alone,
        expecting the data to go, as the buffers the two share do in JAX's own runtimes: so
        ``arr``'s delete frees the data at once (the shard then refuses reads), and
        otherwise the data stays while either of them lives."""
        if arr.group is not None:  # a view's shard: another view of the same block
            return dataclasses.replace(arr)
        return dataclasses.replace(arr, alias_of=arr.alias_of if arr.alias_of is not None else arr)

    @_serves("result_handle")
    def _fully_replicated_shard_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle)
        if not arr.sharding.replicated:
            raise t.invalid(f"array {body.array_handle} is not fully replicated")
        if len(arr.sharding.devices) == 1:
            shard = self._shard(arr)
        else:
            full = tuple((0, d) for d in arr.shape)
            shard = self._view(arr, 0, full, _Group(arr))
        handles = self._insert([body.result_handle] if body.result_handle else [], [shard])
        return pb.FullyReplicatedShardResponse(array_handle=handles[0])

    @_serves("result_handles")
    def _disassemble_into_single_device_arrays_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle)
        if len(arr.sharding.devices) == 1:
            shards = [self._shard(arr)]
        else:
            group = _Group(arr)
            shards = [self._view(arr, i, r, group) for i, r in enumerate(t.shard_regions(arr.sharding, arr.shape))]
        handles = self._insert(list(body.result_handles), shards)
        return pb.DisassembleIntoSingleDeviceArraysResponse(array_handles=handles)

    @_serves("result_handle")
    def _assemble_array_from_single_device_arrays_request(self, body: Any) -> Any:
        shape = t.shape_of(body.shape.dims)
        sharding = t.parse_sharding(body.sharding, len(self._table))
        shards = [self._array(h) for h in body.single_device_array_handles]
        dtype = t.dtype_of(body.dtype) if body.HasField("dtype") else None
        result = self._assemble(shape, dtype, sharding, shards)
        handles = self._insert([body.result_handle] if body.result_handle else [], [result])
        return pb.AssembleArrayFromSingleDeviceArraysResponse(array_handle=handles[0])

    def _assemble(self, shape: tuple[int, ...], dtype: Optional[np.dtype], sharding: Sharding,
                  shards: Sequence[_Array]) -> _Array:
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

    @_serves("result_handles")
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
        views: dict[int, list[_Array]] = {}  # input -> a view of each of its shards
        result = []
        for k, ((shape, dtype, even, _), sharding, given) in enumerate(zip(outs, shardings, taken)):
            pairs = [p for p in given if p is not None]
            if len(pairs) < len(given):
                missing = [j for j, p in enumerate(given) if p is None]
                raise t.invalid(f"the remap plan gives output {k} no shards {missing[:16]}")
            sources = {a for a, _ in pairs}
            for a in sources - set(views):
                arr, group = arrays[a], _Group(arrays[a])
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

    @_serves("result_handles")
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

    @_serves("result_handles")
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

    def _moved(self, arr: _Array, sharding: Sharding, semantics: int) -> _Array:
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
        return _Array(arr.dtype, arr.shape, sharding, base + 1, layout, place)

    def _moved_across(self, arr: _Array, sharding: Sharding, semantics: int, spans: bool) -> _Array:
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

    # ---- deletion ----------------------------------------------------------------------------------

    def _delete(self, arr: _Array) -> None:
        if not arr.deleted:
            arr.deleted = True
            self._drop(arr, deleted=True)

    @_serves()
    def _delete_array_request(self, body: Any) -> Any:
        missing = [h for h in body.array_handle if h not in self._arrays]
        for h in body.array_handle:
            if h in self._arrays:
                self._delete(self._arrays[h])
        handle = self._server_handle()
        self._futures[handle] = (_failed(IfrtError(t.NOT_FOUND, f"unknown array handle(s) {missing[:16]}"))
                                 if missing else _DONE)
        return pb.DeleteArrayResponse(deletion_future_handle=handle)

    @_serves()
    def _is_array_deleted_request(self, body: Any) -> Any:
        arr = self._array(body.array_handle, usable=False)
        return pb.IsArrayDeletedResponse(deleted=arr.deleted or (arr.alias_of is not None and arr.alias_of.deleted))

    @_serves()
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

    # ---- compilation and execution --------------------------------------------------------------

    @_serves()
    def _compile_request(self, body: pb.CompileRequest) -> Deferred:
        if body.host_callbacks:
            raise IfrtError(t.UNIMPLEMENTED, "host callbacks (jax.debug.print, pure_callback, io_callback) are "
                                             "not supported by the pathways IFRT server")
        if body.program.type_name != XLA_PROGRAM:
            raise IfrtError(t.UNIMPLEMENTED, f"programs of type {body.program.type_name[:80]!r} are not "
                                             f"supported; the server compiles {XLA_PROGRAM}")
        if body.compile_options.type_name != XLA_COMPILE_OPTIONS:
            raise IfrtError(t.UNIMPLEMENTED, f"compile options of type {body.compile_options.type_name[:80]!r} "
                                             f"are not supported; the server takes {XLA_COMPILE_OPTIONS}")
        try:
            parsed = xla_compiler_pb2.XlaCompileOptionsProto.FromString(body.compile_options.data).compile_options
        except Exception as e:
            raise t.invalid(f"the compile options do not parse ({type(e).__name__})") from None
        ids = executable_devices(parsed, len(self._table))
        # the fields our schema subset leaves out travel as unknown fields: nothing is lost
        options = parsed.SerializeToString()
        place = self._table.place(ids, "the executable's devices")
        artifact = body.program.data

        def run() -> pb.CompileResponse:
            began = now()
            fn, future = self.native.define_xla(place.slice.id, "ifrt", artifact, options, place.pairs)
            label = "failed"  # the compile span's detail until the executable names itself
            try:
                compiled = future.result(timeout=WAIT_SECONDS)
                label = function_label(compiled.name or "ifrt")
            except TimeoutError:
                raise IfrtError(t.DEADLINE_EXCEEDED, f"compilation took longer than {WAIT_SECONDS:g} s") from None
            except errors.WorkerLostError as e:
                raise t.runtime_failure(e, "compilation failed: ") from None
            except errors.PathwaysError as e:
                raise IfrtError(t.INVALID_ARGUMENT, f"compilation failed: {e}") from None
            finally:
                if self.native.traced:  # from the request to the workers' answer: what the program waited
                    self.native.recorder.span("compile", began, 0, label)
            handle, ready = self._server_handle(), self._server_handle()
            with self._lock:
                self._executables[handle] = _Executable(fn, compiled, tuple(ids), place, label)
            self._futures[ready] = _DONE
            return pb.CompileResponse(loaded_executable_handle=handle, name=compiled.name or "ifrt",
                                      num_devices=len(ids), device_ids=ids, addressable_device_ids=ids,
                                      fingerprint_value=compiled.fingerprint.encode(), ready_future_handle=ready)
        return Deferred(run)

    def _executable(self, handle: int) -> _Executable:
        with self._lock:
            exe = self._executables.get(handle)
        if exe is None:
            raise IfrtError(t.NOT_FOUND, f"unknown loaded executable handle {handle}")
        return exe

    @_serves()
    def _loaded_executable_metadata_request(self, body: Any) -> Any:
        c = self._executable(body.loaded_executable_handle).compiled
        resp = pb.LoadedExecutableMetadataResponse()
        resp.parameter_shardings.shardings.extend(t.op_of(s) for s in c.in_shardings)
        resp.output_shardings.shardings.extend(t.op_of(s) for s in c.out_shardings)
        resp.parameter_layouts_list.layouts.extend(xla_data_pb2.LayoutProto(minor_to_major=list(x))
                                                   for x in c.in_layouts)
        resp.output_layouts_list.layouts.extend(xla_data_pb2.LayoutProto(minor_to_major=list(x))
                                                for x in c.out_layouts)
        resp.output_memory_kinds.memory_kind_lists.add(memory_kinds=[t.MEMORY_KIND] * len(c.outs))
        resp.donated_input_indices.donated_input_indices.extend(c.donated)
        memory = c.analysis.memory if c.analysis is not None else None
        if memory is None:
            _unavailable(resp.compiled_memory_stats_error, "compiled memory stats")
        else:
            resp.compiled_memory_stats.CopyFrom(executable_metadata_pb2.CompiledMemoryStatsProto(**dict(memory)))
        return resp

    @_serves("result_array_handle")
    def _loaded_executable_execute_request(self, body: Any) -> Any:
        exe = self._executable(body.loaded_executable_handle)
        c = exe.compiled
        args = [self._array(h) for h in body.args_handles]
        across = [i for i, a in enumerate(args) if a.parts]
        if across:
            islands = sorted({d.island for i in across for d in map(self._table.get, args[i].sharding.devices)})
            raise t.invalid(f"argument(s) {across[:16]} are laid out across islands {islands}, and the executable "
                            f"runs on island {exe.place.slice.island} only: move them to its devices first "
                            "(jax.device_put with a sharding on that island)")
        if len(args) != len(c.ins):
            raise t.invalid(f"the executable takes {len(c.ins)} arguments, {len(args)} were given")
        types = tuple((a.dtype, a.shape) for a in args)
        if not args and not c.outs:
            # nothing in, nothing out (JAX drops unused parameters): nothing can be observed of a
            # run, and a program needs at least one value
            return self._executed([], body)
        if exe.program is None:
            n_in, n_out = len(args), len(c.outs)
            graph = ProgramGraph(n_in + n_out, tuple(range(n_in)),
                                 (Node(exe.fn, tuple(range(n_in)), tuple(range(n_in, n_in + n_out))),),
                                 tuple(range(n_in, n_in + n_out)),
                                 tuple((d.name, s) for d, s in types) + tuple((d, tuple(s)) for d, s in c.out_types))
            exe.program, exe.in_types = register_program(self.native, graph, {}, {}).program_id, types
            exe.outputs = tuple((dtype_of_name(d), tuple(s), Sharding(exe.devices, c.out_shardings[j]), layout,
                                 self._table.at(exe.place.slice, layout.devices, layout.workers), j in c.token_outs)
                                for j, (layout, (d, s)) in enumerate(zip(c.outs, c.out_types)))
        elif types != exe.in_types:
            raise t.invalid(f"arguments {[(d.name, s) for d, s in types]} do not match the executable's "
                            f"{[(d.name, s) for d, s in exe.in_types]}")
        args = [self._real(a) for a in args]
        base = self.native.allocate(len(args) + len(c.outs))
        self.native.submit(exe.program, base, {i: a.handle for i, a in enumerate(args)}, exe.label)
        first = base + len(args)
        outs = [_Array(dtype, shape, sharding, first + j, layout, place, token=token)
                for j, (dtype, shape, sharding, layout, place, token) in enumerate(exe.outputs)]
        if c.donated:
            keep = set(body.execute_options.non_donatable_input_indices)
            for i in c.donated:
                if i not in keep and i < len(args):
                    self._delete(args[i])
        return self._executed(outs, body)

    def _executed(self, outs: list[_Array], body: Any) -> Any:
        """The response to execute request ``body`` whose outputs are ``outs``."""
        resp = pb.LoadedExecutableExecuteResponse()
        handles = self._insert(list(body.result_array_handle), outs)
        if body.execute_options.fill_status:
            status = body.result_status_handle or self._server_handle()
            done = self._reads([o.handle for o in outs if o.handle is not None])
            self._futures[status] = Lazy(lambda: self._wait_ready(outs), done)
            resp.status_handle = status
        if not body.result_array_handle:
            for arr, h in zip(outs, handles):
                resp.outputs.add(dtype=t.dtype_proto(arr.dtype), shape=t.shape_proto(arr.shape),
                                 sharding=t.sharding_proto(arr.sharding), array_handle=h)
        return resp

    @_serves()
    def _loaded_executable_destruct_request(self, body: Any) -> Any:
        with self._lock:
            exe = self._executables.pop(body.loaded_executable_handle, None)
        if exe is None:
            raise IfrtError(t.NOT_FOUND, f"unknown loaded executable handle {body.loaded_executable_handle}")
        return pb.LoadedExecutableDestructResponse()

    @_serves()
    def _loaded_executable_delete_request(self, body: Any) -> Any:
        handle = self._server_handle()
        self._futures[handle] = _failed(IfrtError(t.UNIMPLEMENTED, "LoadedExecutable::Delete is no longer "
                                                                   "supported; destruct the executable"))
        return pb.LoadedExecutableDeleteResponse(future_handle=handle)

    @_serves()
    def _loaded_executable_is_deleted_request(self, body: Any) -> Any:
        self._executable(body.loaded_executable_handle)
        return pb.LoadedExecutableIsDeletedResponse(is_deleted=False)

    def _analysis(self, handle: int) -> m.Analysis:
        """What the worker's XLA said of executable ``handle`` when it compiled it."""
        return self._executable(handle).compiled.analysis or m.Analysis()

    @_serves()
    def _loaded_executable_cost_analysis_request(self, body: Any) -> Any:
        cost = self._analysis(body.loaded_executable_handle).cost
        resp = pb.LoadedExecutableCostAnalysisResponse()
        if cost is None:
            _unavailable(resp.status, "cost analysis")
        else:
            _attributes(resp.attributes, dict(cost))
        return resp

    @_serves()
    def _loaded_executable_human_readable_program_text_request(self, body: Any) -> Any:
        text = self._analysis(body.loaded_executable_handle).text
        resp = pb.LoadedExecutableHumanReadableProgramTextResponse()
        if text is None:
            _unavailable(resp.status, f"program text (of at most {m.MAX_PROGRAM_TEXT} characters)")
        else:
            resp.human_readable_program_text = text
        return resp

    # ---- defaults -------------------------------------------------------------------------------

    @_serves()
    def _get_default_layout_request(self, body: Any) -> Any:
        t.dtype_of(body.dtype)
        self._table.get(body.device_id)
        return pb.GetDefaultLayoutResponse(serialized_pjrt_layout=t.default_layout_text(len(body.dims)))

    @_serves()
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


def _attributes(proto: attribute_map_pb2.AttributeMapProto, values: dict[str, Any]) -> None:
    proto.version_number = 0
    for key, value in values.items():
        attribute = proto.attributes[key]
        if isinstance(value, str):
            attribute.string_value = value.encode()
        elif isinstance(value, bool):  # before int: a bool is an int
            attribute.bool_value = value
        elif isinstance(value, float):  # a float32, as XLA's cost analysis has it
            attribute.float_value = value
        else:
            attribute.int64_value = int(value)


def _unavailable(status: Any, what: str) -> None:
    """Fill ``status`` (a StatusProto) to say the worker's XLA gave no ``what`` for the
    executable: UNIMPLEMENTED, which JAX raises as NotImplementedError, as it does locally
    on a backend that has none."""
    status.code = t.UNIMPLEMENTED
    status.message = f"the worker's XLA gave no {what} for this executable"


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


def executable_devices(options: Any, ndevices: int) -> list[int]:
    """The IFRT device ids of an executable, in logical order (replica-major, then
    partition), from the device assignment of CompileOptionsProto ``options``."""
    build = options.executable_build_options
    if not build.HasField("device_assignment"):
        raise t.invalid("the compile options carry no device assignment; compile with jax.jit for devices")
    da = build.device_assignment
    if any(len(cd.replica_device_ids) != da.replica_count for cd in da.computation_devices):
        raise t.invalid(f"the device assignment lists a computation without its {da.replica_count} replicas")
    ids = [int(cd.replica_device_ids[r]) for r in range(da.replica_count) for cd in da.computation_devices]
    if not ids or len(set(ids)) != len(ids) or any(not 0 <= i < ndevices for i in ids):
        raise t.invalid(f"the device assignment {ids[:16]} must name distinct devices among this session's "
                        f"{ndevices}")
    return ids


def _owner(arr: _Array) -> Optional[_Array]:
    """The array whose data ``arr``, a view or a single-device array's shard, reads
    without a reference of its own; None for an array holding its own."""
    return arr.group.parent if arr.group is not None else arr.alias_of


def _shard_of_deleted() -> IfrtError:
    return IfrtError(t.FAILED_PRECONDITION, "the array this shard is of was deleted (Array.delete()), and its data "
                                            "with it; read shards before deleting their array")


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
