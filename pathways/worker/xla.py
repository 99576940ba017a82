"""Compiling and running "xla" functions: a StableHLO portable artifact (what an IFRT proxy
client sends) compiled with the client's xla CompileOptions on given devices of the island.

The executable is wrapped as a callable that takes global jax.Arrays and returns global
jax.Arrays with the NamedShardings of its output layouts, so that the executor, the store,
transfers and fetches treat it like a jax.export function. On an island of several hosts
every host compiles the same executable over all its devices and runs it on the shards it
holds (jax.distributed joins the hosts' collectives).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from pathways.errors import WireError
from pathways.hlo import layout_of_op_sharding, replicated, row_major
from pathways.ir import Device, Layout
from pathways.protocol.messages import MEMORY_STATS, Analysis
from pathways.timeline import function_label
from pathways.worker.compile_cache import CompileCache, digest
from pathways.worker.jax_private import (GSPMDSharding, _jax, array_result_handler, core, hlo,
                                         initialize_cpu_kernels, ir, mlir, xla_bridge, xla_client)
from pathways.worker.shared_arrays import shareable
from pathways.wire.codec import WIRE_DTYPES, dtype_of_name

_DONOR_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")
# how an argument reaches an executable's parameter (XlaExecutable._as_expected)
_AS_IS, _RELABEL, _MOVE = "as is", "relabelled", "moved"

log = logging.getLogger("pathways.worker")


@dataclass(frozen=True)
class Metadata:
    """What the compiled executable says about itself (Compiled's fields but ``fn``)."""

    ins: tuple[Layout, ...]
    outs: tuple[Layout, ...]
    out_types: tuple[tuple[str, tuple[int, ...]], ...]
    in_shardings: tuple[bytes, ...]
    out_shardings: tuple[bytes, ...]
    in_layouts: tuple[tuple[int, ...], ...]
    out_layouts: tuple[tuple[int, ...], ...]
    donated: tuple[int, ...]
    fingerprint: str
    name: str
    analysis: Analysis
    token_outs: tuple[int, ...] = ()  # the outputs that are tokens (passed as empty bool arrays)


def fingerprint(artifact: bytes, options: bytes, devices: Sequence[Device], workers: Sequence[int]) -> str:
    """The compile cache's key of an "xla" function: the same artifact and options on the
    same devices compile once."""
    return digest(artifact, options, repr((tuple(devices), tuple(workers))).encode())


class XlaExecutable:
    """A loaded executable as a function of global jax.Arrays (see the module's doc)."""

    def __init__(self, loaded: Any, in_avals: list, in_shardings: list, in_named: list, out_shardings: list,
                 metadata: Metadata) -> None:
        self._loaded = loaded
        self._in = in_shardings  # GSPMDShardings over the executable's devices, in its order
        self._in_named = in_named  # NamedShardings of the parameter layouts: the same blocks on the same devices
        # what makes each output's global jax.Array of its buffers: JAX's own result handler (a
        # fifth of make_array_from_single_device_arrays' cost, which checks what XLA guarantees)
        self._out_handlers = [
            functools.partial(_token, sharding) if j in metadata.token_outs else
            array_result_handler(core.ShapedArray(shape, dtype_of_name(dtype)), sharding)
            for j, ((dtype, shape), sharding) in enumerate(zip(metadata.out_types, out_shardings))]
        self._equivalent: dict[tuple[int, Any], str] = {}  # (parameter, sharding) -> _AS_IS, _RELABEL or _MOVE
        self.in_avals = in_avals  # (shape, dtype) per parameter
        self.metadata = metadata
        # what a timeline names its runs by: the function the client compiled (its definition
        # carries no name: an IFRT client sends none)
        self.label = function_label(metadata.name)

    def __call__(self, *args: Any) -> list:
        return self._execute(args, False)[0]

    def launch(self, *args: Any) -> tuple[list, Any]:
        """The outputs, as ``__call__``, and XLA's token of the run, whose
        ``block_until_ready()`` returns once the run is done (its outputs may be donated to a
        later run and deleted before anyone waits for them)."""
        return self._execute(args, True)

    def _execute(self, args: tuple, with_token: bool) -> tuple[list, Any]:
        if len(args) != len(self._in):
            raise ValueError(f"the executable takes {len(self._in)} arguments, got {len(args)}")
        self._check(args)
        inputs = [self._as_expected(i, x) for i, x in enumerate(args)]
        results = self._loaded.execute_sharded(inputs, with_tokens=with_token)
        token = results.consume_token() if with_token else None
        return results.consume_with_handlers(self._out_handlers), token

    def _check(self, args: tuple) -> None:
        """ValueError unless every argument has its parameter's shape and dtype, and no
        donated argument is also given as another. XLA's CPU client checks these only as it
        launches a run, and one that fails them on an executable of several devices kills
        the process (a null dereference in its launch) instead of raising; one of the same
        size in another dtype would run on the reinterpreted bits. A microsecond or two."""
        for i, (x, (shape, dtype)) in enumerate(zip(args, self.in_avals)):
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(f"{self.label}'s parameter {i} is {np.dtype(dtype).name}{list(shape)}, but it was "
                                 f"given a {x.dtype.name}{list(x.shape)} array")
        for d in self.metadata.donated:
            if any(y is args[d] for j, y in enumerate(args) if j != d):
                raise ValueError(f"{self.label}'s parameter {d} is donated, and the same array was given as another "
                                 "parameter too: donate a copy")

    def _as_expected(self, i: int, x: Any) -> Any:
        """Argument ``i`` with its buffers in the executable's device order: the same
        shards relabelled when its sharding gives each device the block the parameter's
        does (the controller moved it there), else moved. A buffer on the wrong device is
        an error in XLA, and data in the wrong place would be a wrong result. Blocks, not
        JAX's sharding equivalence, decide: a mesh in tile order and XLA's iota tile
        assignment (``<=[2,2]T(1,0)``) place the same blocks but list devices differently."""
        expected = self._in[i]
        key = (i, x.sharding)
        how = self._equivalent.get(key)
        if how is None:
            # the layout's sharding, not XLA's: JAX maps no blocks for an unreduced GSPMDSharding
            if x.sharding.devices_indices_map(x.shape) != self._in_named[i].devices_indices_map(x.shape):
                how = _MOVE
            elif tuple(x.sharding._device_assignment) == tuple(expected._device_assignment):
                # its buffers are already in the executable's device order: XLA reads the
                # buffers alone, so the array goes as it is (relabelling it costs more than the run
                # of a small program)
                how = _AS_IS
            else:
                how = _RELABEL
            if len(self._equivalent) < 1024:
                self._equivalent[key] = how
        if how is _AS_IS:
            return x
        shareable(x)  # both read its per-device buffers
        if how is _MOVE:
            x = jax.device_put(x, self._in_named[i])  # JAX moves arrays between NamedShardings only
        return jax.make_array_from_single_device_arrays(x.shape, expected, [s.data for s in x.addressable_shards])


def compile_xla(name: str, artifact: bytes, options: bytes, devices: Sequence[Device], workers: Sequence[int],
                island: Mapping[Device, Any], sharding_of: Callable[[Layout], Any],
                cache: Optional[CompileCache] = None) -> XlaExecutable:
    """Compile ``artifact`` with serialized CompileOptionsProto ``options`` on ``devices``
    (logical device i of the executable is ``devices[i]``, hosted by ``workers`` in rank
    order), or load it from ``cache``; ``island`` maps this island's devices to jax devices,
    ``sharding_of`` gives a layout's NamedSharding. Raises WireError (or XLA's error) saying
    what failed."""
    missing = [d for d in devices if d not in island]
    if missing:
        raise WireError(f"function {name!r} names devices {missing} (host rank, index) that this worker's island "
                        f"lacks; it has {sorted(island)}")
    try:
        compile_options = xla_client.CompileOptions.ParseFromString(options)
    except Exception as e:
        raise WireError(f"function {name!r}: the options are no serialized xla CompileOptionsProto ({e})") from None
    replicas, partitions = compile_options.num_replicas, compile_options.num_partitions
    if replicas < 1 or partitions < 1:
        raise WireError(f"function {name!r}: the options ask for {replicas} replica(s) and {partitions} "
                        "partition(s); send a serialized xla CompileOptionsProto with at least one of each")
    if replicas * partitions != len(devices):
        raise WireError(f"function {name!r} is compiled for {replicas} replica(s) x {partitions} partition(s) but "
                        f"given {len(devices)} device(s); give one device per replica and partition")
    jax_devices = tuple(island[d] for d in devices)
    # the client's device ids mean nothing here: logical device i is devices[i]
    compile_options.device_assignment = xla_client.DeviceAssignment.create(
        np.array([d.id for d in jax_devices]).reshape(replicas, partitions))
    in_avals, out_types, donors, token_ins, token_outs = signature(name, artifact)
    # XLA (jaxlib 0.10.2) crashes the process serializing a multi-host executable that takes
    # a token: executables with tokens stay out of the compile cache
    loaded = _compile_and_load(artifact, compile_options, jax_devices,
                               None if token_ins or token_outs else cache)
    donated = aliased_parameters(loaded, compile_options.parameter_is_tupled_arguments) if donors else ()

    workers_by_rank = dict(zip(sorted({r for r, _ in devices}), workers))
    in_ops = _op_shardings(loaded.get_parameter_shardings(), len(in_avals))
    # XLA gives one sharding, of its empty result tuple, for a multi-device executable with no output
    out_ops = _op_shardings(loaded.get_output_shardings(), len(out_types)) if out_types else []
    if len(in_ops) != len(in_avals) or len(out_ops) != len(out_types):
        raise WireError(f"function {name!r}: the executable reports {len(in_ops)} parameter and {len(out_ops)} "
                        f"output shardings for a signature of {len(in_avals)} and {len(out_types)}")
    ins = tuple(layout_of_op_sharding(op, devices, workers_by_rank, len(shape))
                for op, (shape, _) in zip(in_ops, in_avals))
    outs = tuple(layout_of_op_sharding(op, devices, workers_by_rank, len(shape))
                 for op, (_, shape) in zip(out_ops, out_types))
    in_hlo = [xla_client.HloSharding.from_proto(_jax_op_sharding(op)) for op in in_ops]
    if token_ins or token_outs:
        # XLA gives no layouts of a signature with tokens; its arrays have the default ones
        in_layouts = tuple(row_major(len(shape)) for shape, _ in in_avals)
        out_layouts = tuple(row_major(len(shape)) for _, shape in out_types)
    else:
        in_layouts = tuple(_minor_to_major(x) for x in loaded.get_parameter_layouts())
        out_layouts = tuple(_minor_to_major(x) for x in loaded.get_output_layouts())
    metadata = Metadata(ins, outs, tuple(out_types), tuple(in_ops), tuple(out_ops), in_layouts, out_layouts,
                        tuple(donated), fingerprint(artifact, options, devices, workers),
                        _module_name(loaded, name), analysis(loaded), tuple(token_outs))
    return XlaExecutable(loaded, in_avals, [GSPMDSharding(jax_devices, h) for h in in_hlo],
                         [sharding_of(layout) for layout in ins], [sharding_of(layout) for layout in outs],
                         metadata)


def analysis(loaded: Any) -> Analysis:
    """What XLA says of executable ``loaded`` (as much of it as the protocol carries): the
    figures JAX's ``Compiled.cost_analysis()``, ``memory_analysis()`` and ``as_text()``
    give for it where it is compiled."""
    stats = _given(loaded.get_compiled_memory_stats)
    memory = None if stats is None else {k: getattr(stats, k) for k in MEMORY_STATS if hasattr(stats, k)}
    return Analysis.kept(_given(loaded.cost_analysis), memory, _given(loaded.get_hlo_text))


def aliased_parameters(loaded: Any, tupled: bool) -> tuple[int, ...]:
    """The parameters whose buffers executable ``loaded`` reuses for outputs (its modules'
    input/output aliases): those a run consumes, as PjRt donates them. A parameter the
    program offers (``jax.buffer_donor``) that XLA found no output for stays the caller's,
    as on local JAX. ``tupled``: the parameters travel as one tuple."""
    message = _aliases_message()
    found = set()
    for module in loaded.hlo_modules():
        for entry in message.FromString(module.as_serialized_hlo_module_proto()).input_output_alias.entries:
            found.add(entry.parameter_shape_index[0] if tupled and entry.parameter_shape_index
                      else entry.parameter_number)
    return tuple(sorted(found))


@functools.cache
def _aliases_message() -> type:
    """A message class that reads an ``xla.HloModuleProto`` (xla/service/hlo.proto) for its
    ``input_output_alias`` (field 8) alone: the rest of the module is skipped unparsed."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(name="pathways/hlo_aliases.proto", package="pathways.hlo",
                                                syntax="proto3")
    entry = schema.message_type.add(name="AliasEntry")
    entry.field.add(name="parameter_number", number=2, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL)
    entry.field.add(name="parameter_shape_index", number=3, type=field.TYPE_INT64, label=field.LABEL_REPEATED)
    config = schema.message_type.add(name="Aliases")
    config.field.add(name="entries", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_REPEATED,
                     type_name=".pathways.hlo.AliasEntry")
    module = schema.message_type.add(name="Module")
    module.field.add(name="input_output_alias", number=8, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                     type_name=".pathways.hlo.Aliases")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("pathways.hlo.Module"))


def _given(query: Callable[[], Any]) -> Any:
    """What ``query`` of an executable answers; None where this backend gives none (an
    UNIMPLEMENTED error) or fails to: the figures are informative, and the executable runs
    without them, so their failure must not fail the compile."""
    try:
        return query()
    except Exception as e:
        if not str(e).startswith("UNIMPLEMENTED"):
            log.warning("XLA's %s of a compiled executable failed: %s", query.__name__, e)
        return None


def _compile_and_load(artifact: bytes, compile_options: Any, jax_devices: tuple, cache: Optional[CompileCache]) -> Any:
    backend = xla_bridge.get_backend()
    if backend.platform == "cpu":
        initialize_cpu_kernels()
    device_list = xla_client.DeviceList(jax_devices)
    if cache is None:
        return backend.compile_and_load(artifact, device_list, compile_options)
    key = cache.key(backend, artifact, compile_options.SerializeAsString(),
                    repr([d.id for d in jax_devices]).encode())
    loaded = cache.load(key, backend, device_list, compile_options)
    if loaded is None:
        loaded = backend.compile_and_load(artifact, device_list, compile_options)
        cache.store(key, backend, loaded)
    return loaded


class Signature(NamedTuple):
    """An artifact's ``main``. A token parameter or output is an empty bool array
    (TOKEN_AVAL) here, as JAX passes one."""

    ins: list  # (shape, dtype) per parameter
    out_types: list  # (dtype name, shape) per output
    # parameters offered for donation (``tf.aliasing_output`` or ``jax.buffer_donor``);
    # aliased_parameters says which the compiled executable takes
    donors: list[int]
    token_ins: list[int]
    token_outs: list[int]


def signature(name: str, artifact: bytes) -> Signature:
    """The signature of ``artifact``'s ``main``; WireError for types pathways cannot hold."""
    with mlir.make_ir_context():
        try:
            module = _jax.mlir.deserialize_portable_artifact(artifact)
        except Exception:
            try:  # plain MLIR (text or bytecode), which XLA compiles as well
                module = ir.Module.parse(artifact)
            except Exception as e:
                raise WireError(f"function {name!r} is no StableHLO artifact: {e}") from None
        main = next((op for op in module.body.operations if "sym_name" in op.attributes
                     and ir.StringAttr(op.attributes["sym_name"]).value == "main"), None)
        if main is None:
            raise WireError(f"function {name!r}: the artifact has no public function 'main'")
        kind = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        ins = [_aval(name, t, f"parameter {i}") for i, t in enumerate(kind.inputs)]
        outs = [_aval(name, t, f"output {i}") for i, t in enumerate(kind.results)]
        token_ins = [i for i, t in enumerate(kind.inputs) if hlo.TokenType.isinstance(t)]
        token_outs = [i for i, t in enumerate(kind.results) if hlo.TokenType.isinstance(t)]
        donated = []
        if "arg_attrs" in main.attributes:
            for i, attrs in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
                attrs = ir.DictAttr(attrs)
                if any(a in attrs for a in _DONOR_ATTRS):
                    donated.append(i)
    return Signature(ins, [(np.dtype(dtype).name, shape) for shape, dtype in outs], donated, token_ins, token_outs)


# a token as JAX passes one to an executable (core.get_token_aval()): no data
TOKEN_AVAL = ((0,), np.dtype(np.bool_))


def _aval(name: str, t: Any, what: str) -> tuple[tuple[int, ...], np.dtype]:
    if hlo.TokenType.isinstance(t):
        return TOKEN_AVAL
    try:
        tensor = ir.RankedTensorType(t)
    except ValueError:
        raise WireError(f"function {name!r}: {what} is a {t}, neither an array nor a token") from None
    if not tensor.has_static_shape:
        raise WireError(f"function {name!r}: {what} has the dynamic shape {t}; export it with static shapes")
    dtype = _DTYPES.get(str(tensor.element_type))
    if dtype is None:
        raise WireError(f"function {name!r}: {what} has element type {tensor.element_type}, which pathways "
                        "arrays cannot hold")
    return tuple(tensor.shape), dtype


def _dtypes() -> dict[str, np.dtype]:
    """Each wire dtype by the name of its MLIR element type (``i4``, ``f8E4M3FN``, ...)."""
    with mlir.make_ir_context():
        return {str(mlir.dtype_to_ir_type(dtype_of_name(n))): dtype_of_name(n) for n in WIRE_DTYPES}


_DTYPES = _dtypes()


def _op_shardings(shardings: Any, n: int) -> list[bytes]:
    """Serialized OpShardings; an executable of one device reports none: replicated."""
    if shardings is None:
        return [replicated()] * n
    return [s.SerializeToString() for s in shardings]


def _jax_op_sharding(op: bytes) -> Any:
    sharding = xla_client.OpSharding()
    sharding.ParseFromString(op)
    return sharding


def _minor_to_major(layout: Any) -> tuple[int, ...]:
    return tuple(layout._xla_layout().minor_to_major())


def _token(sharding: Any, buffers: list) -> Any:
    """A token output (of XLA's token ``buffers``) as JAX passes tokens in: an empty bool
    array. XLA's own token buffer cannot be read, moved or copied, and a token carries no
    data."""
    shape, dtype = TOKEN_AVAL
    return jax.make_array_from_callback(shape, sharding, lambda _: np.zeros(shape, dtype))


def _module_name(loaded: Any, fallback: str) -> str:
    try:
        return loaded.hlo_modules()[0].name
    except Exception:  # the name is informative only
        return fallback
