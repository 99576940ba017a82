"""Every message of the control plane, one frozen dataclass per kind, and the tables that
say which kinds each stream accepts.

A message travels as a msgpack list ``[tag, field, ...]`` in declaration order (a field
that is itself a record, such as a function's body, as the list of its own fields), inside a
batch (a msgpack list of messages: whatever queued up while the stream was busy). Each
field declares its checker (check.py), so decoding is the one validation at the trust
boundary: it returns typed messages whose every number, size and length is bounded, or a
``Malformed`` entry saying what was wrong with that one message; the rest of the batch is
unaffected. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import math
from typing import Any, ClassVar, Iterable, Mapping, Sequence, Union

from pathways.errors import WireError
from pathways.ir import DISPATCH_MODES, Layout, ProgramGraph
from pathways.protocol.check import (I64, MAX_ITEMS, MAX_NAME, MAX_TEXT, Anything, Bool, Bytes, Checker, Custom,
                                     Fixed, Float, Int, Optional, Seq, Str)
from pathways.protocol.errors import KINDS, POISON_KINDS
from pathways.protocol.handles import MAX_HANDLE, MAX_SESSION, session_of
from pathways.protocol.ops import LAYOUT, MAX_NODES, MAX_REGISTERS, MAX_SENDERS, ROUTE, decode_op, encode_op
from pathways.wire.codec import MAX_MESSAGE_BYTES, is_wire_dtype_name, list_header, pack, pack_each, unpack

PROTOCOL_VERSION = 14
# How a function's blob is to be compiled: a jax.export artifact (its layouts given by the
# client), or a StableHLO portable artifact with xla CompileOptions (layouts reported back
# by the worker that compiles it, in ``Compiled``).
FORMATS = ("jax.export", "xla")
MAX_DEVICES_PER_HOST = 1024  # more than any accelerator host has; bounds a register's cost
MAX_ISLAND = (1 << 31) - 1
MAX_RANK = 1 << 16  # hosts per island
MAX_ISLAND_NAME = 128
MAX_WAIT_SECONDS = 3600.0
MAX_OPTIONS_BYTES = 1 << 20  # a serialized CompileOptionsProto: a few hundred bytes in practice
MAX_XLA_DEVICES = 1 << 16  # devices of one executable
MAX_OP_SHARDING_BYTES = 1 << 20
MAX_RANK_OF_ARRAY = 64
MAX_DIM = (1 << 62) - 1  # the longest any request may ask a server to wait
DEVICE_KINDS = frozenset({"cpu", "gpu", "tpu"})
MAX_PATH = 4096  # a directory a suspended session's arrays are written under

HANDLE = Int(0, MAX_HANDLE)
HANDLES = Seq(HANDLE)
REQ = Int(1, MAX_HANDLE)
NAME = Str(MAX_NAME)
TEXT = Str(MAX_TEXT)
WORKER = Int(0, MAX_ITEMS)
WORKERS = Seq(WORKER)
BLOB = Bytes(MAX_MESSAGE_BYTES)
LAYOUTS = Seq(LAYOUT, max_len=1 << 16)
GRAPH = Custom(ProgramGraph.from_wire, ProgramGraph.to_wire)
CREDENTIAL_BYTES = 32  # a session's secret: 256 random bits, drawn by the controller
CREDENTIAL = Bytes(CREDENTIAL_BYTES, min_len=CREDENTIAL_BYTES)
DIGEST = Bytes(32, min_len=32)
DATA_KEY_BYTES = 32
DATA_KEY = Bytes(DATA_KEY_BYTES, min_len=DATA_KEY_BYTES)
# An output of a run sent with notify this small travels with the news that it was computed
# (Done, then Computed), so that reading it asks no worker: a loss, a metric, a token.
SMALL_VALUE_BYTES = 4096
MAX_SMALL_VALUES = 1024  # of one message
SMALL_VALUE = Bytes(SMALL_VALUE_BYTES)


def digest(credential: bytes) -> bytes:
    """What workers are told of a session's credential: its SHA-256, so that whoever reads
    the controller's stream to a worker (or attaches as one) cannot present it."""
    return hashlib.sha256(credential).digest()


# The sender id the controller shows a worker's data listener: its IFRT front end puts the
# arrays of its clients there, each with the session's credential (as a client's Put does).
CONTROLLER_SENDER = -1


def data_ticket(key: bytes, sender: int) -> bytes:
    """What worker ``sender`` (or the controller, CONTROLLER_SENDER) shows, in its hello, the
    worker whose DataKey is ``key``: only the controller (which draws every worker's key when
    it registers) and that worker can make it, so a data-plane connection that shows it comes
    from worker ``sender`` or the controller, and none from a client, whatever token it
    holds."""
    return hmac.digest(key, b"pathways data-plane sender %d" % sender, "sha256")


def worker_credential(credential: bytes, address: str) -> bytes:
    """What a session presents to the worker at ``address`` (its gRPC address, as the
    controller gives it): an HMAC of the address under the session's credential. A worker
    learns only its own one's digest, so what a client sends it, even to a host that
    should not have been trusted, cannot be presented to any other worker."""
    return hmac.digest(credential, b"pathways worker " + address.encode(), "sha256")


def int_map(key: Int, value: Int) -> Custom:
    """A map of integers sent as a list of [key, value] pairs (msgpack maps may carry keys
    of any type; pairs are checked like any list). A run carries one per call, so
    well-formed pairs are checked without a call per entry, and only a malformed one goes
    through the checkers that name what is wrong."""
    pairs = Seq(Fixed(key, value))
    klo, khi, vlo, vhi = key.lo, key.hi, value.lo, value.hi

    def read(raw: Any) -> dict:
        if (type(raw) is list and len(raw) <= pairs.max_len
                and all(type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int
                        and klo <= p[0] <= khi and vlo <= p[1] <= vhi for p in raw)):
            return dict(raw)
        return dict(pairs.check(raw, "pairs"))

    # msgpack writes a tuple as a list
    return Custom(read, lambda d: list(d.items()))


BINDINGS = int_map(Int(0, MAX_REGISTERS), HANDLE)  # a run's program value -> the handle bound to it


def wire(checker: Checker, default: Any = dataclasses.MISSING) -> Any:
    """Declare a message field and the checker its wire value must pass. A ``default``
    only spares senders from naming it: every field travels on the wire."""
    return dataclasses.field(default=default, metadata={"check": checker})


class Record:
    """A frozen dataclass whose fields each declare their checker (``wire``); ``record``
    makes one. Messages are records with a tag; a record may also be one field of a message
    (``Nested``), sent as the list of its fields in declaration order."""

    FIELDS: ClassVar[tuple[tuple[str, Checker], ...]]

    def checked(self) -> "Record":
        """Checks that span several fields, after each field was checked on its own."""
        return self

    def as_dict(self) -> dict[str, Any]:
        """The record as a map of its fields by name, nested records and tuples as maps and
        lists: what a user reads (``pathways status`` prints it as JSON)."""
        out: dict[str, Any] = {}
        for name, _ in self.FIELDS:
            value = getattr(self, name)
            if isinstance(value, Record):
                value = value.as_dict()
            elif type(value) is tuple:
                value = [v.as_dict() if isinstance(v, Record) else v for v in value]
            out[name] = value
        return out


class Message(Record):
    """Base of every message kind (see ``message``)."""

    TAG: ClassVar[str]

    def encode(self) -> list:
        return [self.TAG, *(c.encode(getattr(self, name)) for name, c in self.FIELDS)]


def record(cls: type) -> type:
    """Make ``cls`` a frozen dataclass and list its fields' checkers, in declaration order."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    cls.FIELDS = tuple((f.name, f.metadata["check"]) for f in dataclasses.fields(cls))
    return cls


def message(tag: str):
    def wrap(cls: type) -> type:
        cls = record(cls)
        cls.TAG = tag
        return cls
    return wrap


class Nested(Checker[Record]):
    """A record as one field of a message: a list of exactly its fields, each checked by its
    own checker (errors name the field within the field), then the record's ``checked``."""

    def __init__(self, cls: type[Record]) -> None:
        self.cls = cls

    def check(self, value: Any, what: str) -> Record:
        fields = self.cls.FIELDS
        if type(value) is not list or len(value) != len(fields):
            got = f"{len(value)} entries" if type(value) is list else type(value).__name__
            raise WireError(f"{what} must be a list of its {len(fields)} fields "
                            f"({', '.join(n for n, _ in fields)}), got {got}")
        return self.cls(*(c.check(v, f"field {name!r} of {what}") for (name, c), v in zip(fields, value))).checked()

    def encode(self, value: Record) -> list:
        return [c.encode(getattr(value, name)) for name, c in self.cls.FIELDS]


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A message of a batch that failed its check: what was wrong, and the request id it
    carried if it had a readable one (so that the error reaches the waiting caller)."""

    error: WireError
    tag: str
    req: int | None


class Table:
    """The message kinds one direction of one stream accepts."""

    def __init__(self, name: str, *kinds: type[Message]) -> None:
        self.name = name
        self.kinds: dict[str, type[Message]] = {k.TAG: k for k in kinds}

    def decode(self, raw: Any) -> Message:
        if type(raw) is not list or not raw or type(raw[0]) is not str:
            raise WireError(f"a message must be a list [tag, field, ...], got {type(raw).__name__}")
        cls = self.kinds.get(raw[0])
        if cls is None:
            raise WireError(f"unknown message {raw[0][:64]!r} on the {self.name} stream; "
                            f"expected one of {sorted(self.kinds)}")
        fields = cls.FIELDS
        if len(raw) != len(fields) + 1:
            raise WireError(f"message {cls.TAG!r} has {len(raw) - 1} fields; it takes {len(fields)} "
                            f"({', '.join(n for n, _ in fields)}): are client and server the same version?")
        values = [c.check(v, f"field {name!r} of message {cls.TAG!r}") for (name, c), v in zip(fields, raw[1:])]
        return cls(*values).checked()

    def decode_batch(self, payload: bytes) -> list[Union[Message, Malformed]]:
        """The messages of one payload; a message that fails its check becomes a
        ``Malformed`` in its place. A payload that is no list of messages at all raises
        WireError."""
        batch = unpack(payload)
        if type(batch) is not list:
            raise WireError(f"a payload must be a list of messages, got {type(batch).__name__}")
        if len(batch) > MAX_BATCH_MESSAGES:
            raise WireError(f"a payload of {len(batch)} messages exceeds the {MAX_BATCH_MESSAGES} one may carry")
        out: list[Union[Message, Malformed]] = []
        for raw in batch:
            try:
                out.append(self.decode(raw))
            except WireError as e:
                out.append(Malformed(e, *_tag_and_req(raw, self)))
        return out

    def decode_one(self, payload: bytes) -> Message:
        """A payload that is a single message (unary requests); raises WireError."""
        return self.decode(unpack(payload))


def _tag_and_req(raw: Any, table: Table) -> tuple[str, int | None]:
    if type(raw) is not list or not raw or type(raw[0]) is not str:
        return "?", None
    cls = table.kinds.get(raw[0])
    names = [n for n, _ in cls.FIELDS] if cls else []
    if "req" in names and len(raw) > names.index("req") + 1:
        req = raw[names.index("req") + 1]
        if type(req) is int and REQ.lo <= req <= REQ.hi:
            return cls.TAG, req
    return (cls.TAG if cls else "?"), None


# Messages one payload may carry: what one read of a stream can make a server do (and reply),
# before it looks again at whether its peer reads the replies (streams.py, LoopOutbox).
MAX_BATCH_MESSAGES = 1 << 16


def encode_batch(messages: list[Message]) -> bytes:
    return pack([m.encode() for m in messages])


def encode_item(message: Message) -> bytes:
    """``message`` encoded as one item of a batch (``join_items``)."""
    return pack_each(message.encode())


def join_items(items: list[bytes]) -> bytes:
    """The batch of messages encoded each by ``encode_item``: byte for byte what
    ``encode_batch`` makes of the messages themselves."""
    return b"".join([list_header(len(items)), *items])


# ---- client <-> controller (the Session stream) -------------------------------------------

@message("hello")
class Hello(Message):
    version: int = wire(Int(0, 1 << 16))
    weight: float = wire(Float(0.0, 1e6, open_lo=True))


@message("slice")
class SliceRequest(Message):
    req: int = wire(REQ)
    kind: str = wire(Str(8, DEVICE_KINDS))
    count: int = wire(Int(1, 1 << 24))
    mesh_shape: tuple[int, ...] | None = wire(Optional(Seq(Int(1, 1 << 24), max_len=16, min_len=1)))
    island: int | None = wire(Optional(Int(0, MAX_ISLAND)))
    exclusive: bool = wire(Bool())


@message("cluster")
class ClusterRequest(Message):
    req: int = wire(REQ)


FORMAT = Str(16, frozenset(FORMATS))
OPTIONS = Bytes(MAX_OPTIONS_BYTES)
DEVICE_PAIRS = Seq(Int(0, MAX_ITEMS), max_len=2 * MAX_XLA_DEVICES)  # flat (host rank, device index) pairs


def device_pairs(flat: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(host rank, device index) pairs from their flat form on the wire (``DEVICE_PAIRS``)."""
    return tuple(zip(flat[::2], flat[1::2]))


def flat_devices(pairs: Iterable[tuple[int, int]]) -> tuple[int, ...]:
    """The flat form on the wire (``DEVICE_PAIRS``) of (host rank, device index) pairs."""
    return tuple(x for pair in pairs for x in pair)


@record
class FunctionBody(Record):
    """A function's definition, as a client gives it and as workers compile it: ``blob``
    compiled under ``name``. For "jax.export" the layouts say where it runs (any devices of
    its slice); for "xla" ``blob`` is a StableHLO portable artifact compiled with
    ``options`` (a serialized xla CompileOptionsProto) on ``devices`` (flat (host rank,
    device index) pairs: logical device i of the executable is pair i), and the layouts
    are reported back by the worker that compiles it (``Compiled``)."""

    name: str = wire(NAME)
    blob: bytes = wire(BLOB)
    ins: tuple[Layout, ...] = wire(LAYOUTS)
    outs: tuple[Layout, ...] = wire(LAYOUTS)
    format: str = wire(FORMAT, "jax.export")
    options: bytes = wire(OPTIONS, b"")
    devices: tuple[int, ...] = wire(DEVICE_PAIRS, ())

    def checked(self) -> "FunctionBody":
        what = f"function {self.name[:64]!r}"
        if self.format == "xla":
            if not self.devices or len(self.devices) % 2:
                raise WireError(f"{what}: an 'xla' function needs its devices as a non-empty flat list of "
                                "(host rank, device index) pairs")
            pairs = device_pairs(self.devices)
            if len(set(pairs)) != len(pairs):
                raise WireError(f"{what}: an 'xla' function names a device twice in its devices")
            if self.ins or self.outs:
                raise WireError(f"{what}: an 'xla' function takes no layouts (ins and outs must be empty): "
                                "the compiled executable says where its parameters and outputs live")
        elif self.options or self.devices:
            raise WireError(f"{what}: a 'jax.export' function takes no options or devices (its layouts say where)")
        return self


BODY = Nested(FunctionBody)


@message("fn")
class DefineFunction(Message):
    """Compile ``body`` on the devices of slice ``slice``; for an "xla" body the worker
    hosting its first device answers with ``Compiled``."""

    id: int = wire(HANDLE)
    slice: int = wire(Int(0, MAX_HANDLE))
    body: FunctionBody = wire(BODY)


@message("program")
class DefineProgram(Message):
    id: int = wire(HANDLE)
    graph: ProgramGraph = wire(GRAPH)
    dispatch: str = wire(Str(16, frozenset(DISPATCH_MODES)))


@message("run")
class Run(Message):
    """``traced``: record the run's steps on every process it touches (timeline.py).
    ``notify``: once every worker has finished the run, tell the session which of its
    outputs were computed (Computed), so that a wait for them asks no worker."""

    program: int = wire(HANDLE)
    base: int = wire(HANDLE)
    inputs: dict[int, int] = wire(BINDINGS)
    traced: bool = wire(Bool(), False)
    notify: bool = wire(Bool(), False)


@message("put")
class PutNotice(Message):
    """A client put an array on the workers of ``layout`` as ``handle``, at the addresses it
    knew after the first ``moves`` SliceMoved messages of its session: a put sent to a host
    that a later SliceMoved replaced never arrived (its array is lost)."""

    handle: int = wire(HANDLE)
    layout: Layout = wire(LAYOUT)
    moves: int = wire(Int(0), 0)


@message("delete")
class Delete(Message):
    handles: tuple[int, ...] = wire(HANDLES)


class Directory(Str):
    """A directory workers write a suspended session's arrays into and read them from: ""
    (none: they stay in the workers' host memory), or absolute with no '..'."""

    def __init__(self) -> None:
        super().__init__(MAX_PATH)

    def check(self, value: Any, what: str) -> str:
        path = super().check(value, what)
        if path and (not path.startswith("/") or ".." in path.split("/") or "\0" in path):
            raise WireError(f"{what}: path {path[:200]!r} must be an absolute directory without '..' components "
                            "(each worker writes its own arrays under it on its own host); pass an absolute path, "
                            "or none to keep the arrays in the workers' host memory")
        return path


@message("suspend")
class Suspend(Message):
    """Suspend the session: admit no more of its runs, wait for those in flight, move its
    arrays off the devices (into the workers' host memory, or into files under ``path``,
    which each worker writes for its own shards), and release its slices."""

    req: int = wire(REQ)
    path: str = wire(Directory(), "")


@message("resume")
class Resume(Message):
    """Place the suspended session's slices again (anywhere they fit) and bring its arrays
    back onto the new devices; its functions and programs work again."""

    req: int = wire(REQ)


@message("suspended")
class Suspended(Message):
    """The session is suspended: ``arrays`` were moved off the devices, ``nbytes`` in all;
    ``warning``: what went other than asked (a worker that could not write to the path
    kept its arrays in host memory), or ""."""

    req: int = wire(REQ)
    arrays: int = wire(Int(0))
    nbytes: int = wire(Int(0))
    warning: str = wire(TEXT, "")


@message("resumed")
class Resumed(Message):
    """The session runs again: ``arrays`` are back on the devices of its slices, which
    the SliceMoved messages before this one placed."""

    req: int = wire(REQ)
    arrays: int = wire(Int(0))


@message("welcome")
class SessionWelcome(Message):
    """The session's number, and its credential: the secret that workers ask of every put
    and fetch of its arrays."""

    session: int = wire(Int(1, MAX_SESSION))
    credential: bytes = wire(CREDENTIAL)


@message("computed")
class Computed(Message):
    """Outputs of a run sent with ``notify`` that every worker has finished: computed, or,
    with ``failed``, at least one output of the run failed (reading them says which, and why);
    the small ones' ``values``."""

    handles: tuple[int, ...] = wire(HANDLES)
    failed: bool = wire(Bool(), False)
    # (handle, its bytes in C order) of the outputs small enough (SMALL_VALUE_BYTES) and held
    # whole by one worker
    values: tuple[tuple[int, bytes], ...] = wire(Seq(Fixed(HANDLE, SMALL_VALUE), max_len=MAX_SMALL_VALUES), ())


@message("slice")
class SliceReply(Message):
    req: int = wire(REQ)
    slice: int = wire(Int(0, MAX_HANDLE))
    workers: tuple[int, ...] = wire(WORKERS)
    addresses: tuple[str, ...] = wire(Seq(NAME))
    island: int = wire(Int(0, MAX_ISLAND))
    devices: tuple[int, ...] = wire(Seq(Int(0, MAX_ITEMS)))  # flat (host rank, device index) pairs
    mesh_shape: tuple[int, ...] = wire(Seq(Int(1, 1 << 24), max_len=16))


@message("moved")
class SliceMoved(Message):
    """Slice ``slice`` of the session now lives on these hosts (SliceReply's fields): its
    island healed with new processes, or the session resumed elsewhere. The client's
    slice, and every array and function on it, follow."""

    slice: int = wire(Int(0, MAX_HANDLE))
    workers: tuple[int, ...] = wire(WORKERS)
    addresses: tuple[str, ...] = wire(Seq(NAME))
    island: int = wire(Int(0, MAX_ISLAND))
    devices: tuple[int, ...] = wire(Seq(Int(0, MAX_ITEMS)))


# ---- the cluster's status (controller/status.py): a session's ClusterReply, the Status method ----


class Health(enum.Enum):
    """An island's health, as the controller judges it (controller/islands.py)."""

    ASSEMBLING = "assembling"  # its hosts have not all joined yet, for the first time
    HEALTHY = "healthy"  # all its hosts joined: it runs and takes slices
    LOST = "lost"  # a host was lost: the others were told to restart, none has joined again yet
    HEALING = "healing"  # its hosts are joining again after a loss; healthy once the core says healed


HEALTH_STATES = frozenset(h.value for h in Health)
# A session's state: active, or where its suspend or resume stands (controller/suspension.py).
ACTIVE, DRAINING, OFFLOADING, SUSPENDED, RESUMING = "active", "draining", "offloading", "suspended", "resuming"
SESSION_STATES = frozenset({ACTIVE, DRAINING, OFFLOADING, SUSPENDED, RESUMING})
POLICIES = ("fair", "fifo")  # the scheduler's (controller/scheduler.py); the first is the default
COUNT = Int(0, 1 << 62)
SECONDS = Float(0.0, 1e12)
RATE = Float(0.0, 1e30)  # FLOP/s, bytes/s


@record
class IslandStatus(Record):
    """One island: ``state`` its health (assembling, healthy, lost, healing) and ``healthy``
    whether it runs and (unless ``retiring``) takes slices; ``hosts`` joined of
    ``expected_hosts``; ``lost``: which host was lost and how, from the loss until it heals;
    ``recovery``: what brings it back, in words (None while healthy)."""

    island: int = wire(Int(0, MAX_ISLAND))
    name: str = wire(Str(MAX_ISLAND_NAME))
    state: str = wire(Str(16, HEALTH_STATES))
    healthy: bool = wire(Bool())
    lost: str | None = wire(Optional(TEXT))
    healing: bool = wire(Bool())
    assembling: bool = wire(Bool())
    hosts: int = wire(Int(0, MAX_RANK))
    expected_hosts: int = wire(Int(1, MAX_RANK))
    retiring: bool = wire(Bool())
    recovery: str | None = wire(Optional(TEXT))
    devices: int = wire(Int(0, MAX_ITEMS))
    queued: int = wire(COUNT)
    inflight: int = wire(COUNT)


@record
class WorkerStatus(Record):
    """One worker host: where it serves, its island and rank, its devices and memory;
    ``flops`` as measured (None until measured); ``load`` the slices placed on each device;
    ``slow`` the seconds it has been silent past the heartbeat timeout while its host still
    acknowledges (starved, busy or stopped: slow, not lost), None while it answers."""

    worker: int = wire(WORKER)
    address: str = wire(NAME)
    data_address: str = wire(NAME)
    island: int = wire(Int(0, MAX_ISLAND))
    island_name: str = wire(Str(MAX_ISLAND_NAME))
    rank: int = wire(Int(0, MAX_RANK))
    kind: str = wire(Str(8, DEVICE_KINDS))
    devices: int = wire(Int(0, MAX_DEVICES_PER_HOST))
    pid: int = wire(Int(0, 1 << 32))
    host: str = wire(NAME)
    memory_bytes: int = wire(Int(0, 1 << 60))
    flops: float | None = wire(Optional(RATE))
    load: tuple[int, ...] = wire(Seq(COUNT, max_len=MAX_DEVICES_PER_HOST))
    slow: float | None = wire(Optional(SECONDS))


@record
class LinkStatus(Record):
    """A measured link from worker ``src`` to worker ``dst``: seconds, bytes per second."""

    src: int = wire(WORKER)
    dst: int = wire(WORKER)
    latency: float = wire(SECONDS)
    bandwidth: float = wire(RATE)


@record
class SessionStatus(Record):
    """One client session: its slices, arrays, programs and their ``nodes`` (over every
    program it defined); ``state`` "active", or where its suspend or resume stands, with
    what it moved off the devices; the scheduler's figures (None for a session that has
    not run anything yet)."""

    session: int = wire(Int(1, MAX_SESSION))
    slices: int = wire(COUNT)
    arrays: int = wire(COUNT)
    programs: int = wire(COUNT)
    nodes: int = wire(COUNT)
    state: str = wire(Str(16, SESSION_STATES))
    suspended_arrays: int | None = wire(Optional(COUNT), None)
    suspended_bytes: int | None = wire(Optional(COUNT), None)
    suspended_to: str | None = wire(Optional(TEXT), None)
    weight: float | None = wire(Optional(Float(0.0, 1e12)), None)
    queued: int | None = wire(Optional(COUNT), None)
    inflight: int | None = wire(Optional(COUNT), None)
    completed: int | None = wire(Optional(COUNT), None)
    device_seconds: float | None = wire(Optional(SECONDS), None)

    def as_dict(self) -> dict[str, Any]:
        """Only the figures the session has: the suspension's while it is not active, the
        scheduler's once it has any."""
        return {k: v for k, v in Record.as_dict(self).items() if v is not None}


@record
class ArrayTraffic(Record):
    """The array bytes the controller's process moved, counted since it started: those of
    its IFRT front end's clients (their puts received, their reads sent) and those its
    front end's sessions moved to and from workers on their behalf."""

    from_clients: int = wire(COUNT)
    to_clients: int = wire(COUNT)
    to_workers: int = wire(COUNT)
    from_workers: int = wire(COUNT)


@message("status")
class ClusterStatus(Message):
    """The cluster as the controller sees it (controller/status.py)."""

    policy: str = wire(Str(8, frozenset(POLICIES)))
    window: int = wire(Int(1, MAX_ITEMS))
    islands: tuple[IslandStatus, ...] = wire(Seq(Nested(IslandStatus)))
    workers: tuple[WorkerStatus, ...] = wire(Seq(Nested(WorkerStatus)))
    links: tuple[LinkStatus, ...] = wire(Seq(Nested(LinkStatus)))
    sessions: tuple[SessionStatus, ...] = wire(Seq(Nested(SessionStatus)))
    slices: int = wire(COUNT)
    arrays: int = wire(COUNT)
    front_end: ArrayTraffic | None = wire(Optional(Nested(ArrayTraffic)), None)


@message("cluster")
class ClusterReply(Message):
    req: int = wire(REQ)
    status: ClusterStatus = wire(Nested(ClusterStatus))


@message("poisoned")
class Poisoned(Message):
    """These handles will never hold a value: reading them raises ``kind``. To a client:
    its arrays; to a worker: copies on their way to it from a lost host."""

    handles: tuple[int, ...] = wire(HANDLES)
    kind: str = wire(Str(32, POISON_KINDS))
    message: str = wire(TEXT)


@message("error")
class Error(Message):
    """A request failed (``req``), or, with no ``req``, a message was refused."""

    req: int | None = wire(Optional(REQ))
    kind: str = wire(Str(32, frozenset(KINDS)))
    message: str = wire(TEXT)


# ---- worker <-> controller (the worker stream: framed TCP) ----------------------------------------------

# Islands assemble themselves: a worker names its island and its size (and may ask for a
# rank); the controller assigns ranks and answers with the island's coordinator address.

@message("register")
class Register(Message):
    """A worker joins: where it serves (gRPC, data plane), its devices, and its island:
    the island's name, how many hosts it has, the rank asked for (None: the controller
    assigns the next free one), and ``coordinator``, ``HOST:PORT`` this host reserved to
    run the island's jax.distributed coordinator should it be rank 0 ("" for an island of
    one host)."""

    address: str = wire(NAME)
    data_address: str = wire(NAME)
    kind: str = wire(Str(8, DEVICE_KINDS))
    devices: int = wire(Int(1, MAX_DEVICES_PER_HOST))
    island: str = wire(Str(MAX_ISLAND_NAME))
    island_hosts: int = wire(Int(1, MAX_RANK))
    rank: int | None = wire(Optional(Int(0, MAX_RANK - 1)))
    coordinator: str = wire(NAME)
    pid: int = wire(Int(0, 1 << 32))
    host: str = wire(NAME)
    memory_bytes: int = wire(Int(0, 1 << 60))
    data_tls: bool = wire(Bool(), False)  # its data listener speaks TLS (--data-plane-tls)


@message("done")
class Done(Message):
    """Runs this worker finished, each with the device seconds it took; ``failed``: those of
    them with an output that failed here (a poison stands for it); ``values``: small outputs
    of those sent with notify, held whole here."""

    runs: tuple[tuple[int, float], ...] = wire(Seq(Fixed(Int(0), Float(0.0, 1e9))))
    failed: tuple[int, ...] = wire(Seq(Int(0)), ())
    # (run, handle, bytes) of the small outputs of those of them sent with notify (Computed)
    values: tuple[tuple[int, int, bytes], ...] = wire(
        Seq(Fixed(Int(0), HANDLE, SMALL_VALUE), max_len=MAX_SMALL_VALUES), ())


@message("undelivered")
class Undelivered(Message):
    """Transfer copies this worker could not send to worker ``receiver`` although it
    computed them (the link to it failed, or it refused the connection): the controller
    poisons them there, so that the run waiting for them fails now instead of at its
    input wait's bound. Only a sender the run names for a copy is heard for it."""

    receiver: int = wire(WORKER)
    copies: tuple[int, ...] = wire(HANDLES)
    message: str = wire(TEXT)


@message("broken")
class GroupBroken(Message):
    """A collective of run ``run`` failed on this worker (``message``): its island's
    jax.distributed group is broken for good (gloo keeps a failed context, so every later
    collective of the group fails too), and the island must restart its hosts to serve again."""

    run: int = wire(Int(0))
    message: str = wire(TEXT)


@message("step")
class Step(Message):
    """A node of a sequentially dispatched run finished on this worker."""

    run: int = wire(Int(0))
    node: int = wire(Int(0, MAX_NODES))


@message("notice")
class Notice(Message):
    """Something the other side should log: a message it sent was refused, and why."""

    message: str = wire(TEXT)


_SECONDS = Optional(Float(0.0, 3600.0, open_lo=True))
_BYTES_PER_SECOND = Optional(Float(0.0, 1e15, open_lo=True))


@message("measured")
class Measured(Message):
    """What a worker measured: job id (0: on its own), FLOP/s (None: not measured),
    memory, and ``(peer, latency s, bandwidth B/s)`` per link, both None for a peer that
    did not answer."""

    id: int = wire(Int(0))
    flops: float | None = wire(Optional(Float(0.0, 1e21, open_lo=True)))
    memory_bytes: int = wire(Int(1, 1 << 60))
    links: tuple[tuple[int, float | None, float | None], ...] = wire(
        Seq(Fixed(WORKER, _SECONDS, _BYTES_PER_SECOND), max_len=1 << 16))

    def checked(self) -> "Measured":
        for peer, latency, bandwidth in self.links:
            if (latency is None) != (bandwidth is None):
                raise WireError(f"the link to worker {peer} needs both latency and bandwidth, or neither")
        return self


@message("welcome")
class WorkerWelcome(Message):
    """A registered worker's id, the id of its island, its rank there, the island's
    jax.distributed coordinator (``HOST:PORT`` rank 0 reserved; "" for one host), and
    ``copies``: the first transfer copy it may receive. A worker id is reused when a host
    replaces the one that had it, and peers may still be sending the old host copies of runs
    dispatched before: the newcomer drops those."""

    worker: int = wire(WORKER)
    island: int = wire(Int(0, MAX_ISLAND))
    rank: int = wire(Int(0, MAX_RANK - 1))
    coordinator: str = wire(NAME)
    copies: int = wire(HANDLE, 0)


@message("data_key")
class DataKey(Message):
    """A registered worker's id and the key it checks its peers' tickets with (see
    ``data_ticket``): sent before any Peers, only to that worker."""

    worker: int = wire(WORKER)
    key: bytes = wire(DATA_KEY)


@message("peers")
class Peers(Message):
    """Workers' data-plane addresses, each with the ticket that opens a connection to it
    (``data_ticket`` of its key and the id of the worker told)."""

    peers: tuple[tuple[int, str, bytes], ...] = wire(Seq(Fixed(WORKER, NAME, DIGEST)))


@message("compile")
class Compile(Message):
    """Compile function ``fn`` (DefineFunction's body); ``workers`` are the worker ids of
    the hosts of its devices, in island-rank order."""

    fn: int = wire(HANDLE)
    body: FunctionBody = wire(BODY)
    workers: tuple[int, ...] = wire(WORKERS, ())

    def checked(self) -> "Compile":
        if self.body.format == "xla":
            ranks = {r for r in self.body.devices[::2]}
            if len(self.workers) != len(ranks) or len(set(self.workers)) != len(self.workers):
                raise WireError(f"function {self.body.name[:64]!r} has devices on {len(ranks)} host(s) but names "
                                f"{len(self.workers)} worker(s); it needs one distinct worker per host")
        return self


_SHAPE = Seq(Int(0, MAX_DIM), max_len=MAX_RANK_OF_ARRAY)
_MINOR_TO_MAJOR = Seq(Int(0, MAX_RANK_OF_ARRAY - 1), max_len=MAX_RANK_OF_ARRAY)
_OP_SHARDING = Bytes(MAX_OP_SHARDING_BYTES)
_WIRE_DTYPE = Custom(lambda raw: _dtype_name(raw), lambda name: name)


def _dtype_name(raw: Any) -> str:
    if not is_wire_dtype_name(raw):
        raise WireError(f"{str(raw)[:32]!r} is not a dtype arrays may have on the wire")
    return raw


# The compiled memory figures an executable reports (xla CompiledMemoryStats, whose proto
# has these fields): bytes of generated code, arguments, outputs, aliased buffers and
# temporaries, on the device and on the host, and the peak of device memory.
MEMORY_STATS = ("generated_code_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                "alias_size_in_bytes", "temp_size_in_bytes", "peak_memory_in_bytes",
                "host_generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
                "host_alias_size_in_bytes", "host_temp_size_in_bytes")
MAX_COST_ENTRIES = 4096  # XLA's cost analysis gives a few per operand, so a few dozen in practice
MAX_PROGRAM_TEXT = 8 << 20  # characters: the HLO text of a large model is a few MB


def _cost_value(raw: Any) -> Union[bool, int, float]:
    # what XLA's cost analysis gives (PjRt's value types, numbers only): a bool, an int64 or a finite float
    if (type(raw) is bool or (type(raw) is int and -I64 - 1 <= raw <= I64)
            or (type(raw) is float and math.isfinite(raw))):
        return raw
    raise WireError(f"a cost must be a bool, an int64 or a finite float, got {str(raw)[:32]!r}")


_COST = Seq(Fixed(NAME, Custom(_cost_value, lambda v: v)), max_len=MAX_COST_ENTRIES)
_MEMORY = Seq(Fixed(Str(64, frozenset(MEMORY_STATS)), Int(0)), max_len=len(MEMORY_STATS))
_PROGRAM_TEXT = Str(MAX_PROGRAM_TEXT)


@record
class Analysis(Record):
    """What XLA says of an executable where it was compiled, as JAX gives it locally:
    ``cost`` its cost analysis (``Compiled.cost_analysis()``: (name, value) pairs),
    ``memory`` its compiled memory figures (``Compiled.memory_analysis()``: (name of
    MEMORY_STATS, bytes) pairs), ``text`` its optimized HLO text (``Compiled.as_text()``).
    Each is None where the worker's XLA gives none, or (the text) more than the protocol
    carries."""

    cost: tuple[tuple[str, Union[bool, int, float]], ...] | None = wire(Optional(_COST), None)
    memory: tuple[tuple[str, int], ...] | None = wire(Optional(_MEMORY), None)
    text: str | None = wire(Optional(_PROGRAM_TEXT), None)

    def checked(self) -> "Analysis":
        if self.memory is not None and len({name for name, _ in self.memory}) != len(self.memory):
            raise WireError("an executable's memory figures name one figure twice")
        return self

    @classmethod
    def kept(cls, cost: Mapping[str, Any] | None, memory: Mapping[str, Any] | None,
             text: str | None) -> "Analysis":
        """The analysis of what the protocol carries, from what XLA gave: the cost entries
        and memory figures that pass their checks (the first MAX_COST_ENTRIES of the former,
        by name), and the text if it is at most MAX_PROGRAM_TEXT characters."""
        def fits(checker: Checker, value: Any) -> bool:
            try:
                checker.check(value, "")
                return True
            except WireError:
                return False
        entry, figure = _COST.item, _MEMORY.item
        return cls(None if cost is None else
                   tuple((k, v) for k, v in sorted(cost.items(), key=lambda kv: str(kv[0]))
                         if fits(entry, [k, v]))[:MAX_COST_ENTRIES],
                   None if memory is None else tuple((k, v) for k, v in memory.items() if fits(figure, [k, v])),
                   text if text is not None and fits(_PROGRAM_TEXT, text) else None)


@message("compiled")
class Compiled(Message):
    """An "xla" function compiled (``error`` "") or failed to: sent by the worker hosting
    its first device, forwarded unchanged to the function's session. Describes the
    executable's parameters and outputs as it reports them: where each lives (``ins``,
    ``outs``), each output's (dtype name, global shape), serialized xla OpShardings,
    minor_to_major layouts, the indices of donated parameters, and what XLA says of it
    (``analysis``: its cost, memory figures and program text). ``token_outs``: the outputs
    that are tokens, which carry no data (held as empty bool arrays). ``kind``: the error's
    kind where the controller refused or cut the compile (a lost host: WorkerLostError),
    "" for a worker's compile error."""

    fn: int = wire(HANDLE)
    error: str = wire(TEXT)
    ins: tuple[Layout, ...] = wire(LAYOUTS, ())
    outs: tuple[Layout, ...] = wire(LAYOUTS, ())
    out_types: tuple[tuple[str, tuple[int, ...]], ...] = wire(Seq(Fixed(_WIRE_DTYPE, _SHAPE), max_len=1 << 16), ())
    in_shardings: tuple[bytes, ...] = wire(Seq(_OP_SHARDING, max_len=1 << 16), ())
    out_shardings: tuple[bytes, ...] = wire(Seq(_OP_SHARDING, max_len=1 << 16), ())
    in_layouts: tuple[tuple[int, ...], ...] = wire(Seq(_MINOR_TO_MAJOR, max_len=1 << 16), ())
    out_layouts: tuple[tuple[int, ...], ...] = wire(Seq(_MINOR_TO_MAJOR, max_len=1 << 16), ())
    donated: tuple[int, ...] = wire(Seq(Int(0, (1 << 16) - 1), max_len=1 << 16), ())
    fingerprint: str = wire(Str(128), "")
    name: str = wire(NAME, "")
    kind: str = wire(Str(32, frozenset({"", *KINDS})), "")
    analysis: Analysis | None = wire(Optional(Nested(Analysis)), None)
    token_outs: tuple[int, ...] = wire(Seq(Int(0, (1 << 16) - 1), max_len=1 << 16), ())

    def checked(self) -> "Compiled":
        if self.error:
            return self
        n_in, n_out = len(self.ins), len(self.outs)
        if not (len(self.in_shardings) == len(self.in_layouts) == n_in
                and len(self.out_types) == len(self.out_shardings) == len(self.out_layouts) == n_out):
            raise WireError(f"compiled function {self.fn:#x} describes {n_in} parameter(s) and {n_out} output(s) "
                            "with lists of other lengths")
        if any(d >= n_in for d in self.donated):
            raise WireError(f"compiled function {self.fn:#x} donates a parameter it does not have")
        if any(j >= n_out for j in self.token_outs):
            raise WireError(f"compiled function {self.fn:#x} names a token output it does not have")
        return self


def _encode_ops(ops: Any) -> list:
    return [op if type(op) is list else encode_op(op) for op in ops]


@message("define")
class Define(Message):
    """A lowered program's op stream for this worker (ops.py), run later by ``RunProgram``."""

    key: int = wire(Int(1))
    session: int = wire(Int(0, MAX_SESSION))
    nvalues: int = wire(Int(1, 1 << 20))
    ncopies: int = wire(Int(0, MAX_REGISTERS - (1 << 20)))
    ops: tuple = wire(Custom(lambda raw: tuple(Seq(Anything(), max_len=1 << 20).check(raw, "ops")), _encode_ops))

    def checked(self) -> "Define":
        nregs = self.nvalues + self.ncopies
        return dataclasses.replace(self, ops=tuple(decode_op(op, nregs) for op in self.ops))


@message("run")
class RunProgram(Message):
    """Run the op stream ``Define`` sent as ``key``, once, as run ``id``: its outputs take
    handles from ``base``, its transfer copies from ``tbase``, and ``args`` binds its inputs."""

    id: int = wire(Int(0))
    key: int = wire(Int(1))
    base: int = wire(HANDLE)
    tbase: int = wire(HANDLE)
    args: dict[int, int] = wire(BINDINGS)
    traced: bool = wire(Bool(), False)  # the client's Run asked for its steps on the timeline
    notify: bool = wire(Bool(), False)  # the client's Run asked to be told (Done's values)


@message("drop_session")
class DropSession(Message):
    """A client left: free its arrays, functions and these program definitions."""

    session: int = wire(Int(1, MAX_SESSION))
    programs: tuple[int, ...] = wire(Seq(Int(1)))


# ---- suspend and resume: a session's arrays leave the devices and come back --------------

@message("offload")
class Offload(Message):
    """Move every array of ``session`` this worker holds off its devices: into host memory,
    or (``path``) into files under ``path``/session-S/worker-W. Answered by Offloaded."""

    session: int = wire(Int(1, MAX_SESSION))
    path: str = wire(Directory(), "")


@message("offloaded")
class Offloaded(Message):
    """What a worker moved off its devices for an Offload: each array's (handle, global
    shape), the arrays that had failed (handle, poison kind, message), the bytes moved, and
    ``warning`` ("" when all went as asked)."""

    session: int = wire(Int(1, MAX_SESSION))
    arrays: tuple[tuple[int, tuple[int, ...]], ...] = wire(Seq(Fixed(HANDLE, _SHAPE)))
    failed: tuple[tuple[int, str, str], ...] = wire(Seq(Fixed(HANDLE, Str(32, POISON_KINDS), TEXT), max_len=1 << 12))
    nbytes: int = wire(Int(0))
    warning: str = wire(TEXT, "")


# (handle, copy, layout, routes): send this host's regions of offloaded array ``handle`` by
# ``routes`` (ops.py's SEND routes) as transfer copy ``copy`` laid out as ``layout``
MOVE = Fixed(HANDLE, HANDLE, LAYOUT, Seq(ROUTE, min_len=1, max_len=1 << 16))


@message("restore")
class Restore(Message):
    """Bring a resumed session's arrays back: push each move's regions to its receivers
    (who adopt the copy as the session's handle, Adopt), then forget every array of the
    session this worker offloaded (the moves' too, and their files)."""

    session: int = wire(Int(1, MAX_SESSION))
    moves: tuple = wire(Seq(MOVE))

    def checked(self) -> "Restore":
        if any(session_of(h) != self.session or session_of(c) != 0 for h, c, _, _ in self.moves):
            raise WireError("restore moves arrays of its own session, as controller transfer copies")
        return self


@message("adopt")
class Adopt(Message):
    """Arrays of a resumed session arrive as transfer copies: store each ``(copy, handle,
    senders)`` of ``arrivals`` as the session's handle once it has arrived, its parts taken
    from the workers ``senders`` only, and answer Adopted once all have (or, after the
    worker's wait timeout, with the late ones poisoned)."""

    session: int = wire(Int(1, MAX_SESSION))
    arrivals: tuple[tuple[int, int, tuple[int, ...]], ...] = wire(
        Seq(Fixed(HANDLE, HANDLE, Seq(WORKER, min_len=1, max_len=MAX_SENDERS))))

    def checked(self) -> "Adopt":
        if any(session_of(c) != 0 or session_of(h) != self.session for c, h, _ in self.arrivals):
            raise WireError("adopt takes controller transfer copies as arrays of its own session")
        return self


@message("adopted")
class Adopted(Message):
    """Every array of an Adopt arrived (``late`` of them did not in time and were poisoned)."""

    session: int = wire(Int(1, MAX_SESSION))
    arrays: int = wire(Int(0))
    late: int = wire(Int(0))


# ---- session isolation: which sessions a worker serves, and their credentials ---------------

@message("open_session")
class SessionOpen(Message):
    """A client session opened: serve puts and fetches of its handles to whoever presents
    the credential whose ``digest`` this is (until DropSession): the session's
    ``worker_credential`` for this worker's address."""

    session: int = wire(Int(1, MAX_SESSION))
    digest: bytes = wire(DIGEST)


@message("shutdown")
class Shutdown(Message):
    """Stop: the registration was refused, or the controller stopped. The worker exits."""

    reason: str = wire(TEXT)


@message("reset")
class Reset(Message):
    """The worker's island lost a host, was stuck past the run timeout, or its group broke in
    a collective: restart in place (same command line) and join the island again, in a fresh
    jax.distributed group with the hosts that replace the lost one. ``stacks``: first write
    every thread's stack to the log (this host had not finished the run the island was
    stuck or broke on)."""

    reason: str = wire(TEXT)
    stacks: bool = wire(Bool(), False)


@message("go")
class Go(Message):
    """Nodes of a sequentially dispatched run that this worker may now run."""

    run: int = wire(Int(0))
    nodes: tuple[int, ...] = wire(Seq(Int(0, MAX_NODES)))


@message("measure")
class Measure(Message):
    id: int = wire(Int(1))


# ---- liveness: both directions of the worker stream --------------------------------------------

@message("heartbeat")
class Heartbeat(Message):
    """Sent when nothing else went out for a while (wire/liveness.py). ``timeout``: the
    seconds of silence after which the sender gives up on the receiver; the receiver sends
    something at least every fifth of it."""

    timeout: float = wire(Float(0.0, 1e6, open_lo=True))


# ---- unary requests -------------------------------------------------------------------------

@message("measure")
class MeasureRequest(Message):
    """Have every worker measure again; wait at most ``timeout`` seconds."""

    timeout: float = wire(Float(0.0, MAX_WAIT_SECONDS, open_lo=True))


@message("retire")
class RetireRequest(Message):
    """An operator retires island ``island`` (its name), or with ``worker`` one host (``island``
    ""): no new slices go there; the controller waits at most ``timeout`` seconds (0: not at
    all) for the runs queued and in flight there to finish, then shuts its hosts down
    (Shutdown: they exit, and their keepers do not start them again), fails what is left
    there and releases its slices. A lost island is forgotten. The reply says what was done
    (operator.Retired), or why not (operator.Failed)."""

    island: str = wire(Str(MAX_ISLAND_NAME))
    worker: int | None = wire(Optional(WORKER))
    timeout: float = wire(Float(0.0, MAX_WAIT_SECONDS))

    def checked(self) -> "RetireRequest":
        if (self.worker is None) == (not self.island):
            raise WireError("retire names an island or a worker, one of the two")
        return self


@message("fetch")
class FetchRequest(Message):
    """Ask a worker for an array: wait up to ``wait`` seconds for it, send its bytes if
    ``data``, else only say it is ready. ``credential`` is that of the handle's session.
    ``device`` (host rank, device index), if given, asks for that one device's buffer
    only (its own bytes even where the layout says another device holds the same block:
    an unreduced array's partial values); else the distinct blocks the host holds."""

    handle: int = wire(HANDLE)
    wait: float = wire(Float(0.0, MAX_WAIT_SECONDS))
    data: bool = wire(Bool())
    credential: bytes = wire(CREDENTIAL)
    device: tuple[int, int] | None = wire(Optional(Fixed(Int(0, MAX_RANK), Int(0, MAX_DEVICES_PER_HOST))), None)


# ---- checkpoints (worker/checkpoints.py): each worker writes and reads its own blocks ----------

MAX_BLOCKS = 1 << 16  # of one array on one host
BLOCK = Seq(Fixed(Int(0, MAX_DIM), Int(0, MAX_DIM)), max_len=MAX_RANK_OF_ARRAY)  # [start, stop) per dimension


@message("save")
class SaveRequest(Message):
    """Client to worker (the Save method): write the blocks ``blocks`` of array ``handle``
    that this host holds into directory ``path`` (a checkpoint location, read under the
    worker's checkpoint directory), once the array is computed, within ``wait`` seconds.
    ``credential`` is that of the handle's session. Answered by Saved or Failed."""

    handle: int = wire(HANDLE)
    credential: bytes = wire(CREDENTIAL)
    path: str = wire(Str(MAX_PATH))
    blocks: tuple = wire(Seq(BLOCK, max_len=MAX_BLOCKS))
    wait: float = wire(Float(0.0, MAX_WAIT_SECONDS))


@message("load")
class LoadRequest(Message):
    """Client to worker (the Load method): make this host's blocks of array ``handle``,
    of ``dtype`` and ``shape`` laid out as ``layout``, from the blocks saved in directory
    ``path`` (whatever layout they were saved in), and store them as a put's would be.
    Answered by Saved (the bytes read) or Failed."""

    handle: int = wire(HANDLE)
    credential: bytes = wire(CREDENTIAL)
    path: str = wire(Str(MAX_PATH))
    layout: Layout = wire(LAYOUT)
    dtype: str = wire(_WIRE_DTYPE)
    shape: tuple = wire(_SHAPE)


@message("saved")
class Saved(Message):
    """A worker wrote (Save) or read (Load) ``nbytes`` bytes of array blocks."""

    nbytes: int = wire(COUNT)


@record
class ColocatedOutput(Record):
    """Where one result of a colocated Python call goes: stored as array ``handle`` laid out
    as ``layout``; or, for a string result (``handle`` 0, no layout), its value answered in
    the reply (``ColocatedDone``)."""

    handle: int = wire(HANDLE)
    layout: Layout | None = wire(Optional(LAYOUT), None)


@message("colocated")
class ColocatedRequest(Message):
    """Client to worker (the Colocated method): run a colocated Python function on this
    host, on its shards of the session's arrays ``inputs`` (once they are computed, within
    ``wait`` seconds), its results stored as ``outputs`` say. ``program`` is the function
    and its argument and result specs as JAX pickled them; ``device_ids`` the IFRT device
    ids the pickle names and ``devices`` the (host rank, device index) pair each of them is
    (flat, in the same order). ``credential`` is that of ``session``, which every handle
    belongs to. Answered by ColocatedDone or Failed."""

    session: int = wire(Int(1, MAX_SESSION))
    credential: bytes = wire(CREDENTIAL)
    program: bytes = wire(BLOB)
    device_ids: tuple[int, ...] = wire(Seq(Int(0, I64), max_len=MAX_XLA_DEVICES))
    devices: tuple[int, ...] = wire(DEVICE_PAIRS)
    inputs: tuple[int, ...] = wire(Seq(HANDLE, max_len=MAX_ITEMS))
    outputs: tuple[ColocatedOutput, ...] = wire(Seq(Nested(ColocatedOutput), max_len=MAX_ITEMS))
    wait: float = wire(Float(0.0, MAX_WAIT_SECONDS))

    def checked(self) -> "ColocatedRequest":
        if len(self.devices) != 2 * len(self.device_ids):
            raise WireError(f"a colocated call names {len(self.device_ids)} device ids but "
                            f"{len(self.devices) // 2} (host rank, device index) pairs")
        if any((o.handle == 0) != (o.layout is None) for o in self.outputs):
            raise WireError("a colocated call's output has a handle and a layout, or (a string result) neither")
        return self


@message("colocated_done")
class ColocatedDone(Message):
    """A worker ran a colocated Python call: ``texts``, the value of each string result
    (UTF-8), in order."""

    texts: tuple[bytes, ...] = wire(Seq(BLOB, max_len=MAX_ITEMS))


@message("profile")
class ProfileRequest(Message):
    """Client to worker (the Profile method): start XLA's profiler in this worker's process
    (``start``), or stop the one ``session`` started there and write its trace into
    directory ``path`` (a location read under the worker's checkpoint directory) as run
    ``run``. ``credential`` is that of ``session``. Answered by Profiled or Failed."""

    session: int = wire(Int(1, MAX_SESSION))
    credential: bytes = wire(CREDENTIAL)
    start: bool = wire(Bool())
    path: str = wire(Str(MAX_PATH))
    run: str = wire(NAME)


@message("profiled")
class Profiled(Message):
    """A worker started its profiler, or stopped it and wrote ``files`` (paths under the
    request's directory)."""

    files: tuple[str, ...] = wire(Seq(Str(MAX_PATH), max_len=MAX_ITEMS))


# ---- timelines (timeline.py): a client collects the spans of its traced runs -----------------

# (name, thread, start ns, duration ns, run: its handle base, detail), on the sender's clock
# Spans one process keeps (all sessions together; pathways/timeline.py), and at most one
# reply carries: a span is at most ~300 bytes on the wire, so a full reply stays well under
# a 64 MiB payload.
MAX_EVENTS = 100_000
MAX_SPAN_NAME = 64
MAX_DETAIL = 128
SPAN = Fixed(Str(MAX_SPAN_NAME), Str(MAX_SPAN_NAME), Int(0), Int(0), HANDLE, Str(MAX_DETAIL))


@message("timeline")
class CollectTimeline(Message):
    """Client to controller (its session stream): hand over, and forget, up to
    ``max_events`` spans of this session's traced runs (0: only the clock and workers)."""

    req: int = wire(REQ)
    max_events: int = wire(Int(0, MAX_EVENTS))


@message("timeline")
class TimelineFetch(Message):
    """Client to worker (the Timeline method): like CollectTimeline, for the session whose
    credential this is."""

    session: int = wire(Int(1, MAX_SESSION))
    credential: bytes = wire(CREDENTIAL)
    max_events: int = wire(Int(0, MAX_EVENTS))


@message("timeline")
class Timeline(Message):
    """Spans of one process (``pid``) and its clock (``perf_counter_ns``) when it answered;
    ``dropped``: spans it lost to a full buffer. From the controller, ``workers`` are the
    gRPC addresses of the workers that ran this session's traced runs (a worker sends ()),
    and ``unfinished`` how many of those runs are still queued or running there, whose
    remaining spans a later request takes."""

    req: int = wire(Int(0, MAX_HANDLE))
    clock: int = wire(Int(0))
    pid: int = wire(Int(0, 1 << 32))
    dropped: int = wire(Int(0))
    events: tuple = wire(Seq(SPAN, max_len=MAX_EVENTS))
    workers: tuple[str, ...] = wire(Seq(NAME, max_len=1 << 16), ())
    unfinished: int = wire(Int(0), 0)


SESSION_UP = Table("session (client to controller)", Hello, SliceRequest, ClusterRequest, DefineFunction,
                   DefineProgram, Run, PutNotice, Delete, CollectTimeline, Suspend, Resume)
SESSION_DOWN = Table("session (controller to client)", SessionWelcome, SliceReply, ClusterReply, Poisoned, Error,
                     Compiled, Timeline, SliceMoved, Suspended, Resumed, Computed)
WORKER_UP = Table("attach (worker to controller)", Register, Done, Step, Notice, Measured,
                  Heartbeat, Compiled, Offloaded, Adopted, Undelivered, GroupBroken)
WORKER_DOWN = Table("attach (controller to worker)", WorkerWelcome, DataKey, Peers, Compile, Define, RunProgram, Delete,
                    DropSession, Poisoned, Shutdown, Go, Measure, Notice, SessionOpen, Heartbeat, Reset,
                    Offload, Restore, Adopt)
MEASURE = Table("measure request", MeasureRequest)
RETIRE = Table("retire request", RetireRequest)
FETCH = Table("fetch request", FetchRequest)
TIMELINE = Table("timeline request", TimelineFetch)
SAVE = Table("save request", SaveRequest)
LOAD = Table("load request", LoadRequest)
COLOCATED = Table("colocated request", ColocatedRequest)
PROFILE = Table("profile request", ProfileRequest)

