"""The messages between an spmd pool and its processes, each pickled (cloudpickle: a call
carries the caller's function) on the pipe between them: the pool sends ``Call`` or
``Exit``; a process answers ``Ready`` once, when its jax.distributed group is up, then a
``Returned`` or ``Raised`` per call. ``Died`` stands for a process whose pipe closed first;
it never crosses the pipe.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

# fn(*args, **kwargs) in every process
Call = NamedTuple("Call", [("fn", Callable[..., Any]), ("args", tuple), ("kwargs", dict)])
Exit = NamedTuple("Exit", [])  # leave: the pool is closing
# the process's place in its group: its index, and the group's and its own device counts
Ready = NamedTuple("Ready", [("process", int), ("devices", int), ("local_devices", int)])
# a call's result, every jax.Array in it made the numpy value of the whole array
Returned = NamedTuple("Returned", [("value", Any)])
# a call raised (or its result could not be sent): the exception's type name, message, traceback
Raised = NamedTuple("Raised", [("kind", str), ("message", str), ("traceback", str)])
# the process's pipe closed before it answered: it exited with this code
Died = NamedTuple("Died", [("code", Any)])

Reply = Union[Ready, Returned, Raised, Died]
