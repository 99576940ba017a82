"""The error kinds that cross the wire, mapped to the exceptions readers raise.

A reply or a poisoned handle names its error by kind (the class name); this registry is
the one table that turns a kind back into a ``pw.*Error`` on the other side. An unknown
kind becomes the fallback the caller gives, so a newer peer cannot make an older one
raise something arbitrary.
"""

from __future__ import annotations

from pathways import errors

KINDS: dict[str, type[errors.PathwaysError]] = {cls.__name__: cls for cls in (
    errors.PathwaysError, errors.PlacementError, errors.WireError, errors.SignatureError,
    errors.RemoteError, errors.WorkerLostError, errors.DeadlineExceededError, errors.ConnectError,
    errors.AccessDeniedError,
    errors.AuthenticationError,
    errors.ControllerLostError, errors.SuspendedError,
)}
# what a poisoned handle may report: a failed computation, a lost host, a run refused
# because it named another session's array, one submitted while its session was suspended,
# or one that outlasted the controller's run timeout
POISON_KINDS = frozenset({"RemoteError", "WorkerLostError", "AccessDeniedError", "SuspendedError",
                          "DeadlineExceededError"})
REMOTE, LOST, DENIED, SUSPENDED, STUCK = ("RemoteError", "WorkerLostError", "AccessDeniedError", "SuspendedError",
                                          "DeadlineExceededError")


def kind_of(error: BaseException) -> str:
    """The wire kind of ``error``: its class name when registered, else its nearest
    registered base class."""
    for cls in type(error).__mro__:
        if cls.__name__ in KINDS and KINDS[cls.__name__] is cls:
            return cls.__name__
    return "PathwaysError"


def error_of(kind: str | None, message: str,
             default: type[errors.PathwaysError] = errors.PathwaysError) -> errors.PathwaysError:
    """The exception a reader raises for an error of ``kind``."""
    return KINDS.get(kind or "", default)(message)
