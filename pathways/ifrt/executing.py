"""Compiling and running executables: a part of the IFRT session (IfrtSession), working on
its state. An executable is an "xla" function of the session's slice run as a one-node
program; its metadata and XLA's analyses come from the worker that compiled it."""

from __future__ import annotations

from typing import Any, Optional, Union

from pathways import errors
from pathways.client.compiled import register_program
from pathways.ifrt import types as t
from pathways.ifrt import handling
from pathways.ifrt.handling import DONE, Deferred, IfrtArray, IfrtExecutable, Lazy, attributes, failed_future, serves
from pathways.ifrt.colocated import CUSTOM_CALL_COMPILE_OPTIONS, CUSTOM_CALL_PROGRAM, ColocatedProgram
from pathways.ifrt.persistence import PLUGIN_COMPILE_OPTIONS, PLUGIN_PROGRAM, PersistenceProgram, plugin_request
from pathways.ifrt.profiling import PROFILE_REQUEST, ProfileProgram, profile_program
from pathways.ifrt.types import IfrtError, Sharding
from pathways.ir import Node, ProgramGraph
from pathways.proto.xla import xla_data_pb2
from pathways.proto.xla.pjrt.proto import executable_metadata_pb2
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.proto.xla.python.pjrt_ifrt import xla_compiler_pb2
from pathways.protocol import messages as m
from pathways.timeline import function_label, now
from pathways.wire.codec import dtype_of_name


class Executing:
    """IfrtSession's requests that compile, run, describe and delete executables."""

    # ---- compilation and execution --------------------------------------------------------------

    @serves()
    def _compile_request(self, body: pb.CompileRequest) -> Deferred:
        if body.host_callbacks:
            raise IfrtError(t.UNIMPLEMENTED, "host callbacks (jax.debug.print, pure_callback, io_callback) are "
                                             "not supported by the pathways IFRT server")
        kinds = (body.program.type_name, body.compile_options.type_name)
        if kinds == (PLUGIN_PROGRAM, PLUGIN_COMPILE_OPTIONS):
            kind, request = plugin_request(body.program.data)
            if kind == PROFILE_REQUEST:
                return self._compiled_program(profile_program(request), "profile", [])
            return self._compile_persistence(kind, request)
        if kinds == (CUSTOM_CALL_PROGRAM, CUSTOM_CALL_COMPILE_OPTIONS):
            return self._compile_colocated(body.program.data)
        if body.program.type_name != handling.XLA_PROGRAM:
            raise IfrtError(t.UNIMPLEMENTED, f"programs of type {body.program.type_name[:80]!r} are not "
                                             f"supported; the server compiles {handling.XLA_PROGRAM}s, "
                                             f"{PLUGIN_PROGRAM}s that write or read checkpoints or profile, and "
                                             f"{CUSTOM_CALL_PROGRAM}s of colocated Python")
        if body.compile_options.type_name != handling.XLA_COMPILE_OPTIONS:
            raise IfrtError(t.UNIMPLEMENTED, f"compile options of type {body.compile_options.type_name[:80]!r} "
                                             f"are not supported; the server takes {handling.XLA_COMPILE_OPTIONS}")
        try:
            parsed = xla_compiler_pb2.XlaCompileOptionsProto.FromString(body.compile_options.data).compile_options
        except Exception as e:
            raise t.invalid(f"the compile options do not parse ({type(e).__name__})") from None
        ids = executable_devices(parsed, len(self._table))
        # the fields our schema subset leaves out travel as unknown fields: nothing is lost
        options = parsed.SerializeToString()
        place = self._table.place(ids, "the executable's devices")
        artifact = body.program.data

        def run() -> pb.CompileResponse:
            began = now()
            fn, future = self.native.define_xla(place.slice.id, "ifrt", artifact, options, place.pairs)
            label = "failed"  # the compile span's detail until the executable names itself
            try:
                compiled = future.result(timeout=handling.WAIT_SECONDS)
                label = function_label(compiled.name or "ifrt")
            except TimeoutError:
                raise IfrtError(t.DEADLINE_EXCEEDED,
                                f"compilation took longer than {handling.WAIT_SECONDS:g} s") from None
            except errors.WorkerLostError as e:
                raise t.runtime_failure(e, "compilation failed: ") from None
            except errors.PathwaysError as e:
                raise IfrtError(t.INVALID_ARGUMENT, f"compilation failed: {e}") from None
            finally:
                if self.native.traced:  # from the request to the workers' answer: what the program waited
                    self.native.recorder.span("compile", began, 0, label)
            handle, ready = self._server_handle(), self._server_handle()
            with self._lock:
                self._executables[handle] = IfrtExecutable(fn, compiled, tuple(ids), place, label)
            self._futures[ready] = DONE
            return pb.CompileResponse(loaded_executable_handle=handle, name=compiled.name or "ifrt",
                                      num_devices=len(ids), device_ids=ids, addressable_device_ids=ids,
                                      fingerprint_value=compiled.fingerprint.encode(), ready_future_handle=ready)
        return Deferred(run)

    def _executable(self, handle: int) -> IfrtExecutable:
        exe = self._program(handle)
        if not isinstance(exe, IfrtExecutable):
            raise IfrtError(t.UNIMPLEMENTED, f"a {_kind(exe)} has no metadata, cost analysis or program text")
        return exe

    def _compiled_program(self, program: Any, name: str, ids: list[int]) -> pb.CompileResponse:
        """The compile response for a program that is not XLA's (``program``, run by this
        session's own code), on devices ``ids``."""
        handle, ready = self._server_handle(), self._server_handle()
        with self._lock:
            self._executables[handle] = program
        self._futures[ready] = DONE
        return pb.CompileResponse(loaded_executable_handle=handle, name=name, num_devices=len(ids),
                                  device_ids=ids, addressable_device_ids=ids, ready_future_handle=ready)

    def _program(self, handle: int) -> IfrtExecutable | OtherProgram:
        with self._lock:
            exe = self._executables.get(handle)
        if exe is None:
            raise IfrtError(t.NOT_FOUND, f"unknown loaded executable handle {handle}")
        return exe

    @serves()
    def _loaded_executable_metadata_request(self, body: Any) -> Any:
        exe = self._program(body.loaded_executable_handle)
        resp = pb.LoadedExecutableMetadataResponse()
        if not isinstance(exe, IfrtExecutable):  # no XLA program: no shardings, layouts or memory to tell
            resp.donated_input_indices.SetInParent()
            for status in (resp.parameter_layouts_error, resp.output_layouts_error,
                           resp.compiled_memory_stats_error):
                _unavailable(status, f"metadata (a {_kind(exe)} is not an XLA program)")
            return resp
        c = exe.compiled
        resp.parameter_shardings.shardings.extend(t.op_of(s) for s in c.in_shardings)
        resp.output_shardings.shardings.extend(t.op_of(s) for s in c.out_shardings)
        resp.parameter_layouts_list.layouts.extend(xla_data_pb2.LayoutProto(minor_to_major=list(x))
                                                   for x in c.in_layouts)
        resp.output_layouts_list.layouts.extend(xla_data_pb2.LayoutProto(minor_to_major=list(x))
                                                for x in c.out_layouts)
        resp.output_memory_kinds.memory_kind_lists.add(memory_kinds=[t.MEMORY_KIND] * len(c.outs))
        resp.donated_input_indices.donated_input_indices.extend(c.donated)
        memory = c.analysis.memory if c.analysis is not None else None
        if memory is None:
            _unavailable(resp.compiled_memory_stats_error, "compiled memory stats")
        else:
            resp.compiled_memory_stats.CopyFrom(executable_metadata_pb2.CompiledMemoryStatsProto(**dict(memory)))
        return resp

    @serves("result_array_handle")
    def _loaded_executable_execute_request(self, body: Any) -> Any:
        exe = self._program(body.loaded_executable_handle)
        if isinstance(exe, PersistenceProgram):
            return self._execute_persistence(exe, body)
        if isinstance(exe, ColocatedProgram):
            return self._execute_colocated(exe, body)
        if isinstance(exe, ProfileProgram):
            return self._execute_profile(exe, body)
        c = exe.compiled
        args = [self._array(h) for h in body.args_handles]
        across = [i for i, a in enumerate(args) if a.parts]
        if across:
            islands = sorted({d.island for i in across for d in map(self._table.get, args[i].sharding.devices)})
            raise t.invalid(f"argument(s) {across[:16]} are laid out across islands {islands}, and the executable "
                            f"runs on island {exe.place.slice.island} only: move them to its devices first "
                            "(jax.device_put with a sharding on that island)")
        if len(args) != len(c.ins):
            raise t.invalid(f"the executable takes {len(c.ins)} arguments, {len(args)} were given")
        types = tuple((a.dtype, a.shape) for a in args)
        if not args and not c.outs:
            # nothing in, nothing out (JAX drops unused parameters): nothing can be observed of a
            # run, and a program needs at least one value
            return self._executed([], body)
        if exe.program is None:
            n_in, n_out = len(args), len(c.outs)
            graph = ProgramGraph(n_in + n_out, tuple(range(n_in)),
                                 (Node(exe.fn, tuple(range(n_in)), tuple(range(n_in, n_in + n_out))),),
                                 tuple(range(n_in, n_in + n_out)),
                                 tuple((d.name, s) for d, s in types) + tuple((d, tuple(s)) for d, s in c.out_types))
            exe.program, exe.in_types = register_program(self.native, graph, {}, {}).program_id, types
            exe.outputs = tuple((dtype_of_name(d), tuple(s), Sharding(exe.devices, c.out_shardings[j]), layout,
                                 self._table.at(exe.place.slice, layout.devices, layout.workers), j in c.token_outs)
                                for j, (layout, (d, s)) in enumerate(zip(c.outs, c.out_types)))
        elif types != exe.in_types:
            raise t.invalid(f"arguments {[(d.name, s) for d, s in types]} do not match the executable's "
                            f"{[(d.name, s) for d, s in exe.in_types]}")
        args = [self._real(a) for a in args]
        base = self.native.allocate(len(args) + len(c.outs))
        first = base + len(args)
        # told when the outputs are computed: a wait for them (CheckValueReady) then asks no worker
        self.native.submit(exe.program, base, {i: a.handle for i, a in enumerate(args)}, exe.label,
                           notify=range(first, first + len(c.outs)))
        outs = [IfrtArray(dtype, shape, sharding, first + j, layout, place, token=token)
                for j, (dtype, shape, sharding, layout, place, token) in enumerate(exe.outputs)]
        if c.donated:
            keep = set(body.execute_options.non_donatable_input_indices)
            for i in c.donated:
                if i not in keep and i < len(args):
                    self._delete(args[i])
        return self._executed(outs, body)

    def _executed(self, outs: list[IfrtArray], body: Any, status: Optional[Lazy] = None) -> Any:
        """The response to execute request ``body`` whose outputs are ``outs``; its status
        (where the client asks for one): ``status``, or that the outputs are computed."""
        resp = pb.LoadedExecutableExecuteResponse()
        handles = self._insert(list(body.result_array_handle), outs)
        if body.execute_options.fill_status:
            handle = body.result_status_handle or self._server_handle()
            if status is None:
                done = self._reads([o.handle for o in outs if o.handle is not None])
                status = Lazy(lambda: self._wait_ready(outs), done)
            self._futures[handle] = status
            resp.status_handle = handle
        if not body.result_array_handle:
            for arr, h in zip(outs, handles):
                resp.outputs.add(dtype=t.dtype_proto(arr.dtype), shape=t.shape_proto(arr.shape),
                                 sharding=t.sharding_proto(arr.sharding), array_handle=h)
        return resp

    @serves()
    def _loaded_executable_destruct_request(self, body: Any) -> Any:
        with self._lock:
            exe = self._executables.pop(body.loaded_executable_handle, None)
        if exe is None:
            raise IfrtError(t.NOT_FOUND, f"unknown loaded executable handle {body.loaded_executable_handle}")
        return pb.LoadedExecutableDestructResponse()

    @serves()
    def _loaded_executable_delete_request(self, body: Any) -> Any:
        handle = self._server_handle()
        self._futures[handle] = failed_future(IfrtError(t.UNIMPLEMENTED, "LoadedExecutable::Delete is no longer "
                                                                   "supported; destruct the executable"))
        return pb.LoadedExecutableDeleteResponse(future_handle=handle)

    @serves()
    def _loaded_executable_is_deleted_request(self, body: Any) -> Any:
        self._program(body.loaded_executable_handle)
        return pb.LoadedExecutableIsDeletedResponse(is_deleted=False)

    def _analysis(self, handle: int) -> m.Analysis:
        """What the worker's XLA said of executable ``handle`` when it compiled it."""
        return self._executable(handle).compiled.analysis or m.Analysis()

    @serves()
    def _loaded_executable_cost_analysis_request(self, body: Any) -> Any:
        cost = self._analysis(body.loaded_executable_handle).cost
        resp = pb.LoadedExecutableCostAnalysisResponse()
        if cost is None:
            _unavailable(resp.status, "cost analysis")
        else:
            attributes(resp.attributes, dict(cost))
        return resp

    @serves()
    def _loaded_executable_human_readable_program_text_request(self, body: Any) -> Any:
        text = self._analysis(body.loaded_executable_handle).text
        resp = pb.LoadedExecutableHumanReadableProgramTextResponse()
        if text is None:
            _unavailable(resp.status, f"program text (of at most {m.MAX_PROGRAM_TEXT} characters)")
        else:
            resp.human_readable_program_text = text
        return resp


# the programs that are not XLA's, which the session runs itself
OtherProgram = Union[PersistenceProgram, ColocatedProgram, ProfileProgram]


def _kind(program: OtherProgram) -> str:
    return {PersistenceProgram: "persistence program", ColocatedProgram: "colocated Python function",
            ProfileProgram: "profile request"}[type(program)]


def _unavailable(status: Any, what: str) -> None:
    """Fill ``status`` (a StatusProto) to say the worker's XLA gave no ``what`` for the
    executable: UNIMPLEMENTED, which JAX raises as NotImplementedError, as it does locally
    on a backend that has none."""
    status.code = t.UNIMPLEMENTED
    status.message = f"the worker's XLA gave no {what} for this executable"


def executable_devices(options: Any, ndevices: int) -> list[int]:
    """The IFRT device ids of an executable, in logical order (replica-major, then
    partition), from the device assignment of CompileOptionsProto ``options``."""
    build = options.executable_build_options
    if not build.HasField("device_assignment"):
        raise t.invalid("the compile options carry no device assignment; compile with jax.jit for devices")
    da = build.device_assignment
    if any(len(cd.replica_device_ids) != da.replica_count for cd in da.computation_devices):
        raise t.invalid(f"the device assignment lists a computation without its {da.replica_count} replicas")
    ids = [int(cd.replica_device_ids[r]) for r in range(da.replica_count) for cd in da.computation_devices]
    if not ids or len(set(ids)) != len(ids) or any(not 0 <= i < ndevices for i in ids):
        raise t.invalid(f"the device assignment {ids[:16]} must name distinct devices among this session's "
                        f"{ndevices}")
    return ids
