"""The messages between an spmd pool and its processes, each pickled (cloudpickle: a call
carries the caller's function) on the pipe between them: the pool sends ``Call`` or
``Exit``; a process answers ``Ready`` once, when its jax.distributed group is up, then a
``Returned`` or ``Raised`` per call. ``Died`` stands for a process whose pipe closed first;
it never crosses the pipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass(frozen=True)
class Call:
    """Run ``fn(*args, **kwargs)`` in every process."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Exit:
    """Leave: the pool is closing."""


@dataclass(frozen=True)
class Ready:
    """The process's place in its group: its index and the group's and its own device counts."""

    process: int
    devices: int
    local_devices: int


@dataclass(frozen=True)
class Returned:
    """A call's result, every ``jax.Array`` in it made the numpy value of the whole array."""

    value: Any


@dataclass(frozen=True)
class Raised:
    """A call raised (or its result could not be sent): the exception's type name, message
    and traceback."""

    kind: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Died:
    """The process's pipe closed before it answered: it exited with ``code``."""

    code: Any


Request = Union[Call, Exit]
Reply = Union[Ready, Returned, Raised, Died]
