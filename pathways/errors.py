"""The exceptions the runtime raises. Each message says what to do next."""

from __future__ import annotations


class PathwaysError(Exception):
    """Base class of every error raised by pathways."""


class ConnectError(PathwaysError):
    """A controller or worker could not be reached, or the connection broke."""


class AuthenticationError(ConnectError):
    """A server refused this process: it did not give the cluster's shared token."""


class ControllerLostError(ConnectError):
    """The controller died, closed the session, or stopped answering: the session and every
    array it held are gone."""


class PlacementError(PathwaysError):
    """A virtual slice cannot be mapped onto the cluster's physical devices."""


class SignatureError(PathwaysError, TypeError):
    """Arguments do not match what a compiled function accepts."""


class ProgramTraceError(PathwaysError, TypeError):
    """A ``@pw.program`` did something other than call compiled functions."""


class RemoteError(PathwaysError):
    """A computation failed on a worker; the message is the worker's."""


class DeadlineExceededError(PathwaysError, TimeoutError):
    """A wait ran past its deadline."""


class ArrayDeletedError(PathwaysError):
    """The array's buffers were deleted, so it can no longer be used."""


class WireError(PathwaysError):
    """A wire message was malformed or violated the protocol."""


class AccessDeniedError(PathwaysError):
    """A client named an array, function or program of another session, or a worker was
    given the wrong session credential: each session reads and writes only its own."""


class WorkerLostError(PathwaysError):
    """A worker process died or stopped answering; arrays and computations that involved
    its island are gone."""


class SuspendedError(PathwaysError):
    """The session is suspended (``session.suspend()``): its arrays are off the devices and
    its slices released, so it runs nothing until ``resume()``."""


class ResourceExhaustedError(PathwaysError):
    """A worker refused to hold more for a session: a put or a run's output would take the
    session past its memory quota on that worker (``pathways worker --session-memory``).
    The message names the quota, the session's usage and the request's size. Delete arrays
    the session no longer needs, and go on; other sessions are not affected."""


class SpmdError(PathwaysError):
    """A process of a multi-controller (``pw.spmd``) group failed, died or could not start."""
