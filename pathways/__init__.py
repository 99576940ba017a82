"""pathways: a single-controller runtime for JAX.

One Python client drives many worker hosts: request virtual device slices, compile JAX
functions onto them with ``pw.pmap``/``pw.jit``, and trace several into one ``@pw.program``.
"""

from jax.sharding import PartitionSpec

from pathways.client.api import (connect, default_session, device_get, device_put, disconnect,
                                 local_cluster, make_virtual_device_set, resume, suspend, trace)
from pathways.client.array import Array
from pathways.client.compiled import jit, pmap
from pathways.client.devices import NamedSharding, Slice, VirtualDeviceSet, VirtualMesh
from pathways.client.pipeline import pipeline
from pathways.client.program import program
from pathways import spmd
from pathways.cluster import Island
from pathways.errors import (AccessDeniedError, ArrayDeletedError, AuthenticationError, ConnectError,
                             ControllerLostError, DeadlineExceededError, PathwaysError, PlacementError,
                             ProgramTraceError, RemoteError, SignatureError, SpmdError,
                             SuspendedError, WireError, WorkerLostError)

P = PartitionSpec

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError", "Array", "ArrayDeletedError", "AuthenticationError", "ConnectError", "ControllerLostError",
    "DeadlineExceededError", "Island", "NamedSharding",
    "P", "PartitionSpec", "PathwaysError", "PlacementError", "ProgramTraceError", "RemoteError",
    "SignatureError", "Slice", "SpmdError", "SuspendedError", "VirtualDeviceSet", "VirtualMesh", "WireError", "WorkerLostError", "connect",
    "default_session", "device_get", "device_put", "disconnect", "jit", "local_cluster",
    "make_virtual_device_set", "pipeline", "pmap", "program", "resume", "spmd", "suspend", "trace",
]
