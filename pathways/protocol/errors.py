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
    errors.ControllerLostError, errors.SuspendedError, errors.ResourceExhaustedError,
)}
# the kinds other modules name, so that none writes one as a string of its own
REMOTE, LOST, DENIED, SUSPENDED, STUCK, EXHAUSTED, WIRE = (
    "RemoteError", "WorkerLostError", "AccessDeniedError", "SuspendedError", "DeadlineExceededError",
    "ResourceExhaustedError", "WireError")
# what a poisoned handle may report: a failed computation, a lost host, a run refused
# because it named another session's array, one submitted while its session was suspended,
# or one that outlasted the controller's run timeout, or an array a worker would not hold
# past its session's memory quota
POISON_KINDS = frozenset({REMOTE, LOST, DENIED, SUSPENDED, STUCK, EXHAUSTED})
# A data-plane answer is a message alone: a worker puts this before a quota's refusal, so
# that the sender raises ResourceExhaustedError for it (``answer_error``).
EXHAUSTED_TAG = "RESOURCE_EXHAUSTED: "


def kind_of(error: BaseException) -> str:
    """The wire kind of ``error``: its class name when registered, else its nearest
    registered base class."""
    for cls in type(error).__mro__:
        if cls.__name__ in KINDS and KINDS[cls.__name__] is cls:
            return cls.__name__
    return "PathwaysError"


def answer_error(message: str) -> tuple[str, str]:
    """The kind of error a data-plane answer's ``message`` reports (a quota's refusal, or
    else a refused put: RemoteError), and its text without the tag."""
    if message.startswith(EXHAUSTED_TAG):
        return EXHAUSTED, message[len(EXHAUSTED_TAG):]
    return REMOTE, message


def error_of(kind: str | None, message: str,
             default: type[errors.PathwaysError] = errors.PathwaysError) -> errors.PathwaysError:
    """The exception a reader raises for an error of ``kind``."""
    return KINDS.get(kind or "", default)(message)
