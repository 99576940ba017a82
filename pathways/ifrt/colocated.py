"""Colocated Python through the front end (``jax.experimental.colocated_python``): a part
of the IFRT session (IfrtSession), working on its state. JAX compiles each colocated
function as an IFRT CustomCallProgram of type ``jax_colocated_python_v0.0.1``: the
function and its argument and result specs pickled, the devices it runs on, and the specs
again as IFRT ArraySpecs. Running it asks every host holding one of those devices to run
the function on its shards (client/colocated.py, worker/colocated.py): arguments and
results stay on the workers.

A function whose result specs JAX does not know yet is first run as a variant returning
them as a string (a scalar of numpy's StringDType, base64 of a pickle): that result comes
back in the hosts' answers, and the front end holds it (``IfrtArray.held``) for the
client to read. String arguments, and string results other than such scalars, are not
supported."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pathways import errors
from pathways.ifrt import types as t
from pathways.ifrt.handling import IfrtArray
from pathways.ifrt.types import IfrtError, Sharding
from pathways.proto.xla.python.ifrt import custom_call_program_pb2, dtype_pb2
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.protocol import messages as m

CUSTOM_CALL_PROGRAM = "xla::ifrt::CustomCallProgram"
CUSTOM_CALL_COMPILE_OPTIONS = "xla::ifrt::CustomCallCompileOptions"
COLOCATED_PYTHON = "jax_colocated_python_v0.0.1"


@dataclass(frozen=True)
class Spec:
    """An argument or result of a colocated function: ``dtype`` None for a string."""

    dtype: Optional[np.dtype]
    shape: tuple[int, ...]
    sharding: Sharding


@dataclass(frozen=True)
class ColocatedProgram:
    """A compiled colocated Python function: ``program`` as JAX pickled it, run on
    ``devices`` (IFRT ids)."""

    name: str
    program: bytes
    devices: tuple[int, ...]
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]


def parse_program(data: bytes, ndevices: int) -> ColocatedProgram:
    """The colocated function a CustomCallProgram's serialized ``data`` holds; IfrtError
    INVALID_ARGUMENT naming what is wrong, UNIMPLEMENTED for another kind of custom call or
    what this server does not run."""
    try:
        proto = custom_call_program_pb2.CustomCallProgramProto.FromString(data)
    except Exception as e:
        raise t.invalid(f"the custom call program does not parse ({type(e).__name__})") from None
    if proto.type != COLOCATED_PYTHON:
        raise IfrtError(t.UNIMPLEMENTED, f"custom call programs of type {proto.type[:80]!r} are not supported; "
                                         f"this server runs {COLOCATED_PYTHON!r} (jax.experimental.colocated_python)")
    devices = tuple(proto.devices.device_ids)
    if not devices or len(set(devices)) != len(devices) or any(not 0 <= d < ndevices for d in devices):
        raise t.invalid(f"the colocated function's devices {list(devices)[:16]} must be distinct devices among "
                        f"this session's {ndevices}")
    if len(proto.serialized_program_text) > m.MAX_MESSAGE_BYTES // 2:
        raise t.invalid(f"the pickled colocated function is {len(proto.serialized_program_text)} bytes; at most "
                        f"{m.MAX_MESSAGE_BYTES // 2} go to the workers")
    inputs = tuple(_spec(s, devices, ndevices, f"argument {i}") for i, s in enumerate(proto.input_specs))
    outputs = tuple(_spec(s, devices, ndevices, f"result {i}") for i, s in enumerate(proto.output_specs))
    if any(s.dtype is None for s in inputs):
        raise IfrtError(t.UNIMPLEMENTED, "string arguments of a colocated function are not supported")
    if any(s.dtype is None and (s.shape or not s.sharding.replicated) for s in outputs):
        raise IfrtError(t.UNIMPLEMENTED, "a colocated function's string results must be replicated scalars")
    return ColocatedProgram(proto.name[:m.MAX_NAME], proto.serialized_program_text, devices, inputs, outputs)


def _spec(proto: Any, devices: tuple[int, ...], ndevices: int, what: str) -> Spec:
    dtype = None if proto.dtype.kind == dtype_pb2.DTypeProto.KIND_STRING else t.dtype_of(proto.dtype)
    sharding = t.parse_sharding(proto.sharding, ndevices)
    if not set(sharding.devices) <= set(devices):
        raise t.invalid(f"{what} lies on devices {list(sharding.devices)[:16]}, not all among the colocated "
                        f"function's {list(devices)[:16]}")
    return Spec(dtype, t.shape_of(proto.shape.dims, f"{what}'s shape"), sharding)


class ColocatedPython:
    """IfrtSession's compile and execute of colocated Python functions."""

    def _compile_colocated(self, data: bytes) -> pb.CompileResponse:
        program = parse_program(data, len(self._table))
        self._table.place(program.devices, "the colocated function's devices")  # one island's, this session's
        return self._compiled_program(program, program.name, list(program.devices))

    def _execute_colocated(self, program: ColocatedProgram, body: Any) -> Any:
        args = [self._array(h) for h in body.args_handles]
        if len(args) != len(program.inputs):
            raise t.invalid(f"the colocated function takes {len(program.inputs)} arguments; {len(args)} were given")
        for i, (arr, spec) in enumerate(zip(args, program.inputs)):
            if (arr.dtype, arr.shape) != (spec.dtype, spec.shape):
                raise t.invalid(f"argument {i} is a {arr.dtype.name}{list(arr.shape)} array; the colocated function "
                                f"takes a {spec.dtype.name}{list(spec.shape)} one")  # type: ignore[union-attr]
            if arr.parts or not set(arr.sharding.devices) <= set(program.devices):
                raise t.invalid(f"argument {i} lies on devices {list(arr.sharding.devices)[:16]}, not all among the "
                                f"colocated function's {list(program.devices)[:16]}")
        args = [self._real(a) for a in args]
        place = self._table.place(program.devices, "the colocated function's devices")
        outputs, outs = [], []
        for spec in program.outputs:
            if spec.dtype is None:
                outputs.append(m.ColocatedOutput(0, None))
                outs.append(None)
                continue
            out_place, layout = self._table.layout(spec.sharding, len(spec.shape))
            handle = self.native.allocate(1)
            outputs.append(m.ColocatedOutput(handle, layout))
            outs.append(IfrtArray(spec.dtype, spec.shape, spec.sharding, handle, layout, out_place))
        done = self._reads([h for a in args for h in a.handles])
        try:
            moves = self.native.moves  # before the addresses: a move in between makes the controller drop them
            call = self.native.run_colocated(place.addresses, program.program, program.devices, place.pairs,
                                             [a.handle for a in args], outputs, moves)
        except BaseException:
            done()
            raise
        call.add_done_callback(lambda _: done())  # the arguments may go once every host has run
        if all(o is not None for o in outs):
            return self._executed(outs, body)
        # a string result (the result specs a first call finds) comes back in the hosts'
        # answers: answered once they are in, before the session's next request, which may
        # name the result already (the client chose its handle)
        try:
            texts = iter(call.result(timeout=m.MAX_WAIT_SECONDS + 60.0)[0].texts)
        except FutureTimeout:
            raise IfrtError(t.DEADLINE_EXCEEDED, f"colocated Python function {program.name!r} did not finish within "
                                                 f"{m.MAX_WAIT_SECONDS + 60.0:g} s") from None
        except errors.PathwaysError as e:
            raise t.runtime_failure(e, f"colocated Python function {program.name!r} failed: ") from None
        for i, spec in enumerate(program.outputs):
            if outs[i] is None:
                outs[i] = IfrtArray(np.dtypes.StringDType(), (), spec.sharding,
                                    held=np.array(next(texts).decode(), dtype=np.dtypes.StringDType()))
        return self._executed(outs, body)
