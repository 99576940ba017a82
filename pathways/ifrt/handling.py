"""What the IFRT session's handlers share: the registry of the request kinds they serve
(``serves``, ``REQUESTS``), the bounds of their waits, the work that waits (``Deferred``)
and the futures a client checks (``Lazy``), and the session's records of arrays and
executables."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from pathways.ifrt import types as t
from pathways.ifrt.devices import SliceDevices
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Layout
from pathways.proto.xla.python.ifrt import attribute_map_pb2


WAIT_SECONDS = 600.0  # the longest any request waits: a fetch, a compile, a ready check
HOST_BUFFER_WAIT = 60.0  # for a host buffer whose HostBufferStore call has not arrived yet, or its next bytes
# Host buffers larger than this go to their worker chunk by chunk as they arrive (when one
# worker holds the array whole); smaller ones in one message once whole.
STREAMED_PUT_BYTES = 1 << 20
MAX_ARRAYS = 1 << 20  # live IFRT handles per session
XLA_PROGRAM = "xla::ifrt::XlaProgram"
XLA_COMPILE_OPTIONS = "xla::ifrt::XlaCompileOptions"
SLICE_KEY = "pathways_slice"


_Handler = Callable[[Any, Any], Any]  # (session, the request's body) -> the response's body, or a Deferred


@dataclass(frozen=True)
class RequestKind:
    """How the session serves one kind of IFRT request."""

    handler: _Handler
    result_handles: Optional[str] = None  # the field of the request naming the handles of the arrays it makes


# request kind (the IfrtRequest field, "..._request") -> how it is served: every kind the
# session serves, each registered by ``serves`` on its handler: the method ``_<kind>`` of
# IfrtSession or of one of its base classes
REQUESTS: dict[str, RequestKind] = {}


def serves(result_handles: Optional[str] = None) -> Callable[[_Handler], _Handler]:
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


def failed_future(error: IfrtError) -> Lazy:
    def wait() -> None:
        raise error
    return Lazy(wait)


DONE = Lazy(lambda: None)


@dataclass
class ViewGroup:
    """Views of one parent array (its shards): the parent is fetched once for all of them."""

    parent: "IfrtArray"
    lock: threading.Lock = field(default_factory=threading.Lock)
    value: Optional[np.ndarray] = None


@dataclass
class IfrtArray:
    dtype: np.dtype
    shape: tuple[int, ...]
    sharding: Sharding
    handle: Optional[int] = None  # the pathways handle; None for a view or an error
    layout: Optional[Layout] = None
    place: Optional[SliceDevices] = None
    group: Optional[ViewGroup] = None  # set for a view: the block ``region`` of group.parent
    region: Optional[t.Region] = None
    error: Optional[IfrtError] = None
    deleted: bool = False
    token: bool = False  # an executable's token output: it has no data to read
    # set for an array laid out across islands: each island's box of it and the array on
    # that island holding the box (handle, layout and place stay None)
    parts: tuple[tuple[t.Region, "IfrtArray"], ...] = ()
    # set for the shard of a single-device array (FullyReplicatedShard, Disassemble...): the
    # array it is, whose pathways handle it names without a reference of its own, as a
    # view does (see IfrtSession._shard)
    alias_of: Optional["IfrtArray"] = None
    # the value the front end itself holds, for an array the workers hold none of (a
    # colocated function's string result: ifrt/colocated.py)
    held: Optional[np.ndarray] = None

    @property
    def handles(self) -> list[int]:
        """The pathways handles holding this array's data (none for a view or an error)."""
        if self.handle is not None:
            return [self.handle]
        return [p.handle for _, p in self.parts if p.handle is not None]


@dataclass
class IfrtExecutable:
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


def attributes(proto: attribute_map_pb2.AttributeMapProto, values: dict[str, Any]) -> None:
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


def shard_of_deleted() -> IfrtError:
    return IfrtError(t.FAILED_PRECONDITION, "the array this shard is of was deleted (Array.delete()), and its data "
                                            "with it; read shards before deleting their array")
