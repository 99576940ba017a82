"""The frames a framed TCP connection exchanges about itself rather than carrying a message
or an array: the hello that opens it and the hello's answer (security.py), a put frame's
answer and a probe (tcp.py).

Each is a frozen record whose ``frame()`` is the only code that writes its map (a msgpack
header, framed) and whose ``read(decoded)`` is the only code that reads one: WireError
naming the field where a decoded header is not the record (not a map, a field missing, of
another type, too long or out of range). Every field is bounded, so that however hostile a
peer, reading its frame costs little. Fields a reader does not know are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from pathways.errors import WireError
from pathways.wire import codec
from pathways.wire.frames import frame

MAX_TOKEN_CHARS = 1024  # gRPC metadata must stay small; 32 random bytes need 43 characters
MAX_TICKET_BYTES = 64  # a data-plane ticket is an HMAC-SHA256: 32 bytes
# A hello's sender is a worker's id, or below 0 for another party (the controller): a 32-bit
# integer, signed.
SENDERS = (-(1 << 31), (1 << 31) - 1)
# The most bytes a connection may send before it is greeted: a hello frame's header (the
# token, and on the data plane a worker id and its ticket).
HELLO_BYTES = MAX_TOKEN_CHARS + 128
MAX_REFUSAL_CHARS = 4096  # of a hello's refusal
MAX_ANSWER_CHARS = 4096  # of a put answer's error message
MAX_PROBE_BYTES = 8 * 1024 * 1024  # of a probe's payload


class _Header:
    """Reads the fields of one decoded header, each bounded, naming the record and field
    in its WireError."""

    def __init__(self, decoded: Any, record: str) -> None:
        if type(decoded) is not dict:
            raise WireError(f"a {record} must be a map, got {codec.brief(decoded)}")
        self.fields, self.record = decoded, record

    def lacks(self, name: str) -> WireError:
        return WireError(f"a {self.record} lacks field {name!r}")

    def _field(self, name: str, optional: bool) -> Any:
        value = self.fields.get(name)
        if value is None and not optional:
            raise self.lacks(name)
        return value

    def _fails(self, name: str, must: str, value: Any) -> WireError:
        return WireError(f"{self.record} field {name!r} must be {must}, got {codec.brief(value)}")

    def tag(self, *tags: str) -> str:
        value = self._field("t", optional=False)
        if value not in tags:
            raise self._fails("t", " or ".join(map(repr, tags)), value)
        return value

    def text(self, name: str, max_chars: int, optional: bool = False) -> Optional[str]:
        value = self._field(name, optional)
        if value is not None and not (type(value) is str and len(value) <= max_chars):
            raise self._fails(name, f"a string of at most {max_chars} characters", value)
        return value

    def blob(self, name: str, max_bytes: int, optional: bool = False) -> Optional[bytes]:
        value = self._field(name, optional)
        if value is not None and not (type(value) is bytes and len(value) <= max_bytes):
            raise self._fails(name, f"binary of at most {max_bytes} bytes", value)
        return value

    def integer(self, name: str, lo: int, hi: int, optional: bool = False) -> Optional[int]:
        value = self._field(name, optional)
        if value is not None and not (type(value) is int and lo <= value <= hi):
            raise self._fails(name, f"an integer in [{lo}, {hi}]", value)
        return value

    def flag(self, name: str) -> bool:
        """A field true or false, false where absent."""
        value = self._field(name, optional=True)
        if value is not None and type(value) is not bool:
            raise self._fails(name, "true or false", value)
        return value is True


class _Tagged:
    TAG: ClassVar[str]  # its header's field "t"

    @classmethod
    def is_one(cls, decoded: Any) -> bool:
        """Whether ``decoded`` (a frame's header) says it is one of these (``read`` checks it)."""
        return type(decoded) is dict and decoded.get("t") == cls.TAG


@dataclass(frozen=True)
class Hello(_Tagged):
    """The frame that opens a connection: the cluster's ``token`` ("" for none, which a
    hello may also leave out) and, on the data plane, the ``sender`` (a worker's id, or the
    controller's) and its ``ticket`` for the receiver (see messages.data_ticket), both or
    neither."""

    token: str = ""
    sender: Optional[int] = None
    ticket: Optional[bytes] = None

    TAG: ClassVar[str] = "hello"

    def frame(self) -> bytes:
        header: dict = {"t": self.TAG, "token": self.token}
        if self.ticket is not None:
            header["from"], header["ticket"] = self.sender, self.ticket
        return frame(codec.pack(header))

    @classmethod
    def read(cls, decoded: Any) -> "Hello":
        h = _Header(decoded, "hello")
        h.tag(cls.TAG)
        token = h.text("token", MAX_TOKEN_CHARS, optional=True) or ""
        sender = h.integer("from", *SENDERS, optional=True)
        ticket = h.blob("ticket", MAX_TICKET_BYTES, optional=True)
        if (sender is None) != (ticket is None):
            raise h.lacks("from" if sender is None else "ticket")
        return cls(token, sender, ticket)


@dataclass(frozen=True)
class HelloAnswer:
    """The answer to a hello: admitted (``refused`` None), or refused and why (cut to
    MAX_REFUSAL_CHARS)."""

    refused: Optional[str] = None

    def frame(self) -> bytes:
        header = ({"t": Hello.TAG} if self.refused is None
                  else {"t": "refused", "error": self.refused[:MAX_REFUSAL_CHARS]})
        return frame(codec.pack(header))

    @classmethod
    def read(cls, decoded: Any) -> "HelloAnswer":
        h = _Header(decoded, "hello's answer")
        if h.tag(Hello.TAG, "refused") == Hello.TAG:
            return cls()
        return cls(h.text("error", MAX_REFUSAL_CHARS))


@dataclass(frozen=True)
class FrameAnswer(_Tagged):
    """A data listener's answer to a put frame that asked for one: ``error`` None once the
    array is stored, else why not (cut to MAX_ANSWER_CHARS); ``closing``: the listener
    closes the connection after it."""

    error: Optional[str] = None
    closing: bool = False

    TAG: ClassVar[str] = "answer"

    def frame(self) -> bytes:
        header: dict = {"t": self.TAG, "error": None if self.error is None else self.error[:MAX_ANSWER_CHARS]}
        if self.closing:
            header["closing"] = True
        return frame(codec.pack(header))

    @classmethod
    def read(cls, decoded: Any) -> "FrameAnswer":
        h = _Header(decoded, "put's answer")
        h.tag(cls.TAG)
        if "error" not in h.fields:  # nil where the array was stored, but present
            raise h.lacks("error")
        return cls(h.text("error", MAX_ANSWER_CHARS, optional=True), h.flag("closing"))


@dataclass(frozen=True)
class Probe(_Tagged):
    """A probe of a link: ``nbytes`` (at most MAX_PROBE_BYTES) follow its header; its
    listener answers with the same header and no payload."""

    nbytes: int

    TAG: ClassVar[str] = "probe"

    def frame(self) -> bytes:
        return frame(codec.pack({"t": self.TAG, "bytes": self.nbytes}))

    @classmethod
    def read(cls, decoded: Any) -> "Probe":
        h = _Header(decoded, "probe")
        h.tag(cls.TAG)
        return cls(h.integer("bytes", 0, MAX_PROBE_BYTES))
