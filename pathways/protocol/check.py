"""Checkers: the one place where untrusted wire values become trusted Python values.

A checker takes a decoded msgpack value and a name for it, and returns the value in the
form the runtime uses (a tuple for a list, a ``Layout`` for a layout, ...) or raises
``WireError`` naming the offending field. Every checker bounds what it accepts: integers
and floats by range (never NaN or infinite), strings, blobs and lists by length, so that
no message, however hostile, makes a server allocate, loop or wait without limit. Each
checker also knows how to turn the runtime's value back into its wire form.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Generic, TypeVar

from pathways.errors import WireError

T = TypeVar("T")

MAX_NAME = 1024  # names, addresses, dtype and kind strings
MAX_TEXT = 64 * 1024  # error messages and reasons
MAX_ITEMS = 1 << 20  # entries of any one list or map
I64 = (1 << 63) - 1
U64 = (1 << 64) - 1


class Checker(Generic[T]):
    """Validates a wire value into ``T`` (``check``) and writes ``T`` back (``encode``)."""

    def check(self, value: Any, what: str) -> T:
        raise NotImplementedError

    def encode(self, value: T) -> Any:
        return value


class Int(Checker[int]):
    def __init__(self, lo: int = 0, hi: int = I64) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: Any, what: str) -> int:
        if type(value) is not int:
            raise WireError(f"{what} must be an integer, got {_kind(value)}")
        if not self.lo <= value <= self.hi:
            raise WireError(f"{what} must be in [{self.lo}, {self.hi}], got {value}")
        return value


class Float(Checker[float]):
    """A finite number in ``[lo, hi]`` (``lo`` excluded when ``open_lo``); NaN and infinities
    are refused, so a bound computed from it is a bound."""

    def __init__(self, lo: float, hi: float, open_lo: bool = False) -> None:
        self.lo, self.hi, self.open_lo = lo, hi, open_lo

    def check(self, value: Any, what: str) -> float:
        if type(value) not in (int, float):
            raise WireError(f"{what} must be a number, got {_kind(value)}")
        value = float(value)
        if not math.isfinite(value) or not (self.lo < value if self.open_lo else self.lo <= value) or value > self.hi:
            bracket = "(" if self.open_lo else "["
            raise WireError(f"{what} must be a finite number in {bracket}{self.lo:g}, {self.hi:g}], got {value!r}")
        return value


class Bool(Checker[bool]):
    def check(self, value: Any, what: str) -> bool:
        if type(value) is not bool:
            raise WireError(f"{what} must be true or false, got {_kind(value)}")
        return value


def clip_text(text: str) -> str:
    """``text`` cut to MAX_TEXT characters, its end marked: an error that quotes what a peer
    sent must still be a message its receiver accepts."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _sized(value: Any, what: str, of_type: type, must_be: str, unit: str, max_len: int, min_len: int = 0) -> None:
    """Raise unless ``value`` is of ``of_type`` (``must_be`` in words) with ``min_len`` to
    ``max_len`` ``unit``."""
    if type(value) is not of_type:
        raise WireError(f"{what} must be {must_be}, got {_kind(value)}")
    if len(value) > max_len:
        raise WireError(f"{what} has {len(value)} {unit}; at most {max_len} are allowed")
    if len(value) < min_len:
        raise WireError(f"{what} has {len(value)} {unit}; at least {min_len} are needed")


class Str(Checker[str]):
    def __init__(self, max_len: int = MAX_NAME, choices: frozenset[str] | None = None) -> None:
        self.max_len, self.choices = max_len, choices

    def check(self, value: Any, what: str) -> str:
        _sized(value, what, str, "a string", "characters", self.max_len)
        if self.choices is not None and value not in self.choices:
            raise WireError(f"{what} must be one of {sorted(self.choices)}, got {value[:64]!r}")
        return value


class Bytes(Checker[bytes]):
    def __init__(self, max_len: int, min_len: int = 0) -> None:
        self.max_len, self.min_len = max_len, min_len

    def check(self, value: Any, what: str) -> bytes:
        _sized(value, what, bytes, "binary", "bytes", self.max_len, self.min_len)
        return value


class Optional(Checker[Any]):
    def __init__(self, inner: Checker) -> None:
        self.inner = inner

    def check(self, value: Any, what: str) -> Any:
        return None if value is None else self.inner.check(value, what)

    def encode(self, value: Any) -> Any:
        return None if value is None else self.inner.encode(value)


class Seq(Checker[tuple]):
    """A list of at most ``max_len`` (and at least ``min_len``) items, as a tuple."""

    def __init__(self, item: Checker, max_len: int = MAX_ITEMS, min_len: int = 0) -> None:
        self.item, self.max_len, self.min_len = item, max_len, min_len

    def check(self, value: Any, what: str) -> tuple:
        if type(value) is not list:
            raise WireError(f"{what} must be a list, got {_kind(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise WireError(f"{what} must have {self.min_len} to {self.max_len} entries, got {len(value)}")
        item = self.item
        if type(item) is Int:  # the common case, without a call per entry
            if not all(type(v) is int and item.lo <= v <= item.hi for v in value):
                bad = next(v for v in value if not (type(v) is int and item.lo <= v <= item.hi))
                item.check(bad, f"an entry of {what}")
            return tuple(value)
        return tuple(item.check(v, f"{what}[{i}]") for i, v in enumerate(value))

    def encode(self, value: Any) -> list:
        item = self.item
        if type(item) in (Int, Float, Str, Bool, Bytes):
            return list(value)
        return [item.encode(v) for v in value]


class Fixed(Checker[tuple]):
    """A list of exactly one value per checker, as a tuple."""

    def __init__(self, *items: Checker) -> None:
        self.items = items

    def check(self, value: Any, what: str) -> tuple:
        if type(value) is not list or len(value) != len(self.items):
            raise WireError(f"{what} must be a list of {len(self.items)} entries, got {_kind(value)}")
        return tuple(c.check(v, f"{what}[{i}]") for i, (c, v) in enumerate(zip(self.items, value)))

    def encode(self, value: Any) -> list:
        return [c.encode(v) for c, v in zip(self.items, value)]


class Custom(Checker[T]):
    """A structure with its own reader: ``read(raw)`` raises WireError (any other exception
    it raises is turned into one), ``write(value)`` gives the wire form back."""

    def __init__(self, read: Callable[[Any], T], write: Callable[[T], Any]) -> None:
        self.read, self.write = read, write

    def check(self, value: Any, what: str) -> T:
        try:
            return self.read(value)
        except WireError as e:
            raise WireError(f"{what}: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
            raise WireError(f"{what} is malformed ({type(e).__name__}: {e})") from None

    def encode(self, value: T) -> Any:
        return self.write(value)


class Anything(Checker[Any]):
    """Any value: only for what a client reads from its own controller (``status``), never
    for what a server accepts."""

    def check(self, value: Any, what: str) -> Any:
        return value


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__
