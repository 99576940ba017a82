"""The data plane's messages: the header of an array sent to a worker (``ArrayPut``: a
client's put, a peer's part of a transfer copy, or the poison that stands for one) and the
header of a fetch's reply (``FetchReply``). Each crosses a process boundary as a map that
wire/codec.py packs, followed by the array's pieces; these classes are the only code that
writes those maps or reads their fields, checked as the control messages are (a malformed
field raises WireError naming it). The pieces' own description (the fields ``array`` and
``pieces``) is wire/codec.py's, which reads the bytes that follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pathways.errors import WireError
from pathways.protocol.check import MAX_TEXT, Int, Str
from pathways.protocol.errors import POISON_KINDS, REMOTE
from pathways.protocol.handles import MAX_HANDLE
from pathways.protocol.messages import CREDENTIAL
from pathways.protocol.ops import MAX_SENDERS

PENDING, READY, ERROR = "pending", "ready", "error"

_HANDLE = Int(0, MAX_HANDLE)
_SENDERS = Int(1, MAX_SENDERS)
_MESSAGE = Str(MAX_TEXT)
_KIND = Str(32)
_PUT = Str(8, frozenset({"put"}))
_STATE = Str(8, frozenset({PENDING, READY, ERROR}))
_PUT_FIELDS = ("t", "handle", "layout", "of")
_PIECES_FIELDS = ("array", "pieces")  # wire/codec.py's description of the pieces


def _pieces(header: dict) -> Optional[dict]:
    """The fields of ``header`` that describe its pieces (codec reads them), if any."""
    pieces = {k: header[k] for k in _PIECES_FIELDS if k in header}
    return pieces or None


def _kind(raw: Any, what: str) -> str:
    """A poison's kind; one this release does not know (a newer peer's) reads as a failed
    computation."""
    kind = _KIND.check(raw, what)
    return kind if kind in POISON_KINDS else REMOTE


@dataclass(frozen=True)
class ArrayPut:
    """Array ``handle``, laid out as ``layout`` (its wire form: the receiver checks it as it
    maps it to its devices), sent in parts by ``senders`` workers. A client's put carries
    its session's ``credential``; a traced run's transfer, the run's base (``run``).
    ``poison`` stands for an array that will not come, its reader getting an error of
    ``kind``; ``unstack``: the unreduced layout (wire form) whose partial values the array
    stacks; ``pieces``: codec's description of the pieces that follow."""

    handle: int
    layout: Any
    senders: int = 1
    credential: Optional[bytes] = None
    run: int = 0
    poison: Optional[str] = None
    kind: str = REMOTE
    unstack: Any = None
    pieces: Optional[dict] = None

    def header(self) -> dict:
        h: dict = {"t": "put", "handle": self.handle, "layout": self.layout, "of": self.senders}
        if self.credential is not None:
            h["credential"] = self.credential
        if self.run:
            h["run"] = self.run
        if self.poison is not None:
            h["poison"], h["kind"] = self.poison, self.kind
        if self.unstack is not None:
            h["unstack"] = self.unstack
        if self.pieces:
            h.update(self.pieces)
        return h

    @classmethod
    def read(cls, header: Any) -> "ArrayPut":
        """The put that ``header`` (a decoded map) describes; WireError if malformed."""
        if type(header) is not dict:
            raise WireError(f"a put header must be a map, got {type(header).__name__}")
        missing = next((f for f in _PUT_FIELDS if f not in header), None)
        if missing is not None:
            raise WireError(f"put header lacks field {missing!r}")
        _PUT.check(header["t"], "put header field 't'")
        credential = header.get("credential")
        poison = header.get("poison")
        return cls(
            handle=_HANDLE.check(header["handle"], "put header field 'handle'"),
            layout=header["layout"],
            senders=_SENDERS.check(header["of"], "put header field 'of' (the number of senders)"),
            credential=None if credential is None else CREDENTIAL.check(credential, "put header field 'credential'"),
            run=_HANDLE.check(header.get("run", 0), "put header field 'run' (a traced run's base)"),
            poison=None if poison is None else _MESSAGE.check(poison, "put header field 'poison'"),
            kind=_kind(header.get("kind", REMOTE), "put header field 'kind'"),
            unstack=header.get("unstack"),
            pieces=_pieces(header))


@dataclass(frozen=True)
class FetchReply:
    """The first frame of a fetch's reply: the array is not computed yet (PENDING), failed
    (ERROR: the ``kind`` of error its reader gets, and ``message``), or READY, with
    ``pieces`` describing the pieces that follow when the fetch asked for the data."""

    state: str
    kind: str = REMOTE
    message: str = ""
    pieces: Optional[dict] = None

    @classmethod
    def error(cls, kind: str, message: str) -> "FetchReply":
        return cls(ERROR, kind, message)

    def header(self) -> dict:
        if self.state == ERROR:
            return {"state": ERROR, "kind": self.kind, "message": self.message}
        return {"state": self.state, **(self.pieces or {})}

    @classmethod
    def read(cls, header: Any) -> "FetchReply":
        """The reply that ``header`` (a decoded map) describes; WireError if malformed. An
        error's kind may name any error class (AccessDeniedError, say), not only a poison's."""
        if type(header) is not dict:
            raise WireError(f"a fetch reply must be a map, got {type(header).__name__}")
        state = _STATE.check(header.get("state"), "fetch reply field 'state'")
        if state == ERROR:
            return cls(ERROR, _KIND.check(header.get("kind", REMOTE), "fetch reply field 'kind'"),
                       _MESSAGE.check(header.get("message", ""), "fetch reply field 'message'"))
        return cls(state, pieces=_pieces(header))


@dataclass(frozen=True)
class PutAnswer:
    """A worker's answer to a client's put: ``error`` None when the array was stored, else
    why not, with the ``kind`` of error (a class name) the client raises for it, if any."""

    error: Optional[str] = None
    kind: Optional[str] = None

    def header(self) -> dict:
        if self.error is None:
            return {"ok": True}
        return {"error": self.error} if self.kind is None else {"error": self.error, "kind": self.kind}

    @classmethod
    def read(cls, header: Any) -> "PutAnswer":
        """The answer ``header`` (a decoded map) gives; WireError if malformed."""
        if type(header) is not dict or not ("error" in header or header.get("ok") is True):
            raise WireError("a put's answer must be a map with field 'error', or 'ok' true")
        if "error" not in header:
            return cls()
        kind = header.get("kind")
        return cls(_MESSAGE.check(header["error"], "put answer field 'error'"),
                   None if kind is None else _KIND.check(kind, "put answer field 'kind'"))
