"""Arrays arriving at a worker: a part of the worker's core (WorkerCore), working on its
state. A client's put (``client_put``), a peer's data frame (``screen_frame``, then
``receive_frame``) or this host's own part of a send; each sender's pieces are assembled
once every sending host has delivered, and the array stored."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import numpy as np

from pathways.errors import AccessDeniedError, ResourceExhaustedError, WireError
from pathways.ir import partials, stacked
from pathways.protocol.data import ArrayPut
from pathways.protocol.errors import EXHAUSTED, EXHAUSTED_TAG
from pathways.protocol.handles import COUNTER_MASK, session_of
from pathways.protocol.ops import LAYOUT
from pathways.timeline import RECORDER, now
from pathways.wire import codec
from pathways.worker.jax_private import pxla  # batched_device_put: where jax.make_array_from_callback ends
from pathways.worker.pieces import host_regions, region_of
from pathways.worker.quota import layout_bytes
from pathways.worker.store import Poison

log = logging.getLogger("pathways.worker")

MAX_CACHED_LAYOUTS = 4096  # the put layouts and assembled layouts each worker keeps parsed


class _Put(NamedTuple):
    put: ArrayPut
    sharding: Any  # the sharding its layout names on this worker


class Receiving:
    """WorkerCore's receiving end of the data plane."""

    # ---- data plane: receiving ----------------------------------------------------------

    def screen_frame(self, sender: int, header: Any) -> Optional[str]:
        """Whether to read a data frame that worker ``sender`` (as its connection's hello
        proved) pushes here: tcp.Listener's screen, called before any of the frame's bytes
        past its header. None to read it, else why not: its bytes are then read past, none
        kept. A transfer copy is read only from a peer that a run of this worker (or an
        Adopt) expects it from, once (ObjectStore.screen); any other (a guess at a copy's
        number, a copy taken already) is refused and counted in ``refused_copies``. Arrays
        of client sessions are left to receive_frame, which admits them by their credential."""
        handle = header.get("handle") if type(header) is dict else None
        if type(handle) is not int or not 0 <= handle <= COUNTER_MASK:  # not a transfer copy (session 0's)
            return None
        if self.store.screen(sender, handle, self.peer_timeout):
            return None
        refusal = (f"worker {self.worker_id} takes no part of transfer copy {handle:#x} from worker {sender}: a "
                   "copy is taken only from the workers its run names as its senders, once from each, until the run "
                   "reads it")
        if refused := self.refused_copies.add():
            log.warning("refused a transfer copy: %s (%d refused so far)", refusal, refused)
        return refusal

    def receive_frame(self, header: dict, pieces: list) -> Optional[str]:
        """A data frame (tcp.Listener's receiver) from a peer or the controller. Peers send
        transfer copies, which are the controller's handles; an array of a client session
        (the controller's IFRT front end puts them here) must carry the session's
        credential, checked as ``client_put`` checks it."""

        def peer_put() -> Optional[str]:
            put = self._read_put(header)
            handle = put.put.handle
            if session_of(handle) != 0:
                try:
                    self._admit_put(put.put, f"a data-plane frame carried array {handle:#x} of client session "
                                    f"{session_of(handle)} without the session's credential; workers send each "
                                    "other only the controller's transfer copies, and clients put arrays with the "
                                    "Put method")
                except AccessDeniedError as e:
                    return str(e)
                try:
                    return self._store(put, None, pieces)
                except ResourceExhaustedError as e:  # tagged, so that the sender raises the same error
                    return f"{EXHAUSTED_TAG}{e}"
            if not put.put.run:
                return self._store(put, None, pieces)
            began = now()
            error = self._store(put, None, pieces)
            RECORDER.span("receive data", began, put.put.run, f"array {handle:#x}")
            return error

        return self._guarded(peer_put)

    def _receive_own(self, put: ArrayPut, pieces: list) -> Optional[str]:
        """This host's own part of an array it sends, stored as its peers store theirs
        (``receive_frame``), without a trip through the data plane."""
        return self._guarded(lambda: self._store(_Put(put, self._sharding(put.layout)), None, pieces))

    def client_put(self, header: Any, chunks: Iterator[bytes]) -> Optional[str]:
        """A client's put (the gRPC Put): take one sender's part of an array, its pieces
        following in ``chunks``, and store the array once every sender has delivered; only
        for a handle of the session whose credential the header carries (field ``credential``), checked
        before any of the array is read, and its pieces following in ``chunks``. Raises
        AccessDeniedError when refused (after waiting up to ``sessions.wait`` seconds for a
        session not announced yet); returns an error message for a malformed put, or None."""

        def admitted() -> Optional[str]:
            put = self._read_put(header)
            self._admit_put(put.put, "put header lacks field 'credential' (the session's, from its welcome)")
            return self._store(put, chunks, None)

        return self._guarded(admitted)

    def store_own_put(self, put: ArrayPut, pieces: list) -> Optional[str]:
        """Store the pieces of ``put`` (admitted already) that this worker made itself (a
        load from a checkpoint), as the client's put of them would be; an error message for
        a put that cannot be stored, or None. Raises ResourceExhaustedError past the quota."""
        return self._guarded(lambda: self._store(self._read_put(put.header()), None, pieces))

    def _admit_put(self, put: ArrayPut, missing: str) -> None:
        """Admit ``put`` to the session whose credential it carries: AccessDeniedError when
        refused, WireError ``missing`` when it carries none."""
        if put.credential is None:
            raise WireError(missing)
        self.sessions.admit(put.handle, put.credential, "put")

    def _guarded(self, put: Callable[[], Optional[str]]) -> Optional[str]:
        try:
            return put()
        except WireError as e:
            return str(e)
        except (AccessDeniedError, ResourceExhaustedError):
            raise
        except Exception as e:  # JAX refusing a hostile layout for this array, say: refuse the put
            log.warning("refused a put: %s: %s", type(e).__name__, e)
            return f"the array cannot be stored as its header describes it ({type(e).__name__}: {e})"

    def _read_put(self, header: Any) -> _Put:
        """The put ``header`` describes and the sharding it names here; WireError if malformed."""
        put = ArrayPut.read(header)
        return _Put(put, self._sharding(put.layout))

    def _store(self, put: _Put, chunks: Optional[Iterator[bytes]], pieces: Optional[list]) -> Optional[str]:
        array, sharding = put.put, put.sharding
        handle, nsenders, described = array.handle, array.senders, array.pieces or {}
        if array.poison is not None:
            self._poisoned(handle, Poison(array.poison, array.kind))
            return None
        if session_of(handle):  # a client's array: refused past its session's quota before its bytes are read
            dtype, shape, _ = codec.check_array_header(described.get("array"))
            refusal = self.store.refusal(handle, layout_bytes(sharding, shape, dtype),
                                         f"a put of {dtype.name}{list(shape)} array {handle:#x}")
            if refusal is not None:
                self._poisoned(handle, Poison(refusal, EXHAUSTED))
                raise ResourceExhaustedError(refusal)
        if chunks is not None:
            dtype, shape, pieces = codec.read_pieces(described, chunks)
            codec.expect_end(chunks)
        else:
            dtype, shape, _ = codec.check_array_header(described.get("array"))
            pieces = pieces or []
        with self._incoming_lock:
            if self.store.get(handle) is not None:
                return None if nsenders > 1 else f"array {handle:#x} already exists on this worker"
            if session_of(handle) == 0 and self.store.refuses(handle):  # a copy read already (or stale):
                self._incoming.pop(handle, None)  # leave no partial assembly behind
                return None
            assembly, seen = self._incoming.pop(handle, (None, 0))
            if assembly is None:
                regions = host_regions(sharding, shape)
                if not regions:
                    raise WireError(f"the layout of array {handle:#x} puts none of it on this worker's devices")
                assembly = codec.Assembly(dtype, shape, regions)
            elif (assembly.dtype, assembly.shape) != (dtype, shape):
                raise WireError(f"pieces of array {handle:#x} disagree on its dtype and shape")
            assembly.add(pieces)
            if seen + 1 < nsenders:
                self._incoming[handle] = (assembly, seen + 1)
                return None
        if not assembly.complete:
            message = (f"the senders of array {handle:#x} delivered pieces that do not cover "
                       f"what this worker holds of it")
            self.store.put(handle, Poison(message), replace=False)
            return message
        value = self._device_arrays.make(sharding, shape, dtype, assembly)
        if array.unstack is not None:
            value = self._unstacked(array, value)
        refusal = self.store.put_charged(handle, value)
        if refusal is not None:  # another put of the session took its last bytes meanwhile
            raise ResourceExhaustedError(refusal)
        return None

    def _unstacked(self, put: ArrayPut, value: Any) -> Any:
        """The unreduced array whose partial values ``value`` stacks (``ir.stacked``): each
        device's block of the stack, its own partial value, stays on its device."""
        layout = LAYOUT.check(put.unstack, "put header field 'unstack'")
        if not layout.unreduced or stacked(layout) != LAYOUT.check(put.layout, "put header field 'layout'"):
            raise WireError("put header field 'unstack' must be a layout with unreduced axes whose stacked layout "
                            "is field 'layout'")
        if value.shape[:1] != (partials(layout),):
            raise WireError(f"the stack of an unreduced array's {partials(layout)} partial values has shape "
                            f"{list(value.shape)}")
        shape = tuple(value.shape[1:])
        sharding = self.executables.sharding(layout)
        mine = {s.device: s.data for s in value.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [mine[d].reshape(sharding.shard_shape(shape)) for d in sharding.addressable_devices])

    def _poisoned(self, handle: int, poison: Poison) -> None:
        """``handle`` will never hold a value (unless it holds one already): the pieces
        some of its senders delivered are read by nobody now."""
        with self._incoming_lock:
            self._incoming.pop(handle, None)
        self.store.put(handle, poison, replace=False)

    def _sharding(self, raw_layout: Any) -> Any:
        """The sharding a put's wire layout names, cached: each run of a program sends the
        same layouts, and parsing one costs more than the rest of a small put."""
        key = repr(raw_layout)
        sharding = self._put_shardings.get(key)
        if sharding is None:
            sharding = self.executables.sharding(LAYOUT.check(raw_layout, "put header field 'layout'"))
            if len(self._put_shardings) < MAX_CACHED_LAYOUTS:
                self._put_shardings[key] = sharding
        return sharding


class DeviceArrays:
    """Makes the jax array of assembled regions on this host's devices. The first array of
    each (sharding, shape, dtype) is made by ``jax.make_array_from_callback``; later ones
    reuse its abstract value and device order and go straight to the device put that it
    ends in, skipping its per-call derivation of them: 4 us instead of 13 for a scalar,
    on the receiving end of every hop of a pipeline."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[Any, list, list]] = {}

    def make(self, sharding: Any, shape: tuple[int, ...], dtype: np.dtype, assembly: codec.Assembly) -> Any:
        key = (sharding, shape, dtype)
        known = self._known.get(key)
        if known is not None:
            aval, devices, regions = known
            return pxla.batched_device_put(aval, sharding, [assembly.region(r) for r in regions], devices)
        array = jax.make_array_from_callback(shape, sharding, lambda index: assembly.region(region_of(index, shape)))
        # A dtype JAX changes (float64 without x64) keeps the general path.
        if array.dtype == dtype and len(self._known) < MAX_CACHED_LAYOUTS:
            indices = sharding.addressable_devices_indices_map(shape)
            self._known[key] = (array.aval, list(indices), [region_of(index, shape) for index in indices.values()])
        return array
