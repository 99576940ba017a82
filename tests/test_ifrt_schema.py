"""The IFRT proxy schema (pathways/ifrt/schema) against the protocol the installed jaxlib speaks.

Our .proto files are subsets of the files jaxlib is built from: they may leave out files,
messages, fields and enum values, and differ in nothing else (no field stands for another type).
A jaxlib whose protocol changed a name, number, type or label we use fails here, not in a user's
process. The generated modules must be what the .proto files generate.
"""

import importlib
from pathlib import Path
from typing import Iterator, Optional

import pytest
from google.protobuf import descriptor_pb2

from pathways.ifrt.schema import embedded, generate
from pathways.ifrt.schema.__main__ import main as schema_main

FileProto = descriptor_pb2.FileDescriptorProto
_FIELD_ATTRS = ("number", "type", "label", "type_name", "proto3_optional", "default_value")


def _module_name(proto: str) -> str:
    return generate.PACKAGE + "." + proto[:-len(".proto")].replace("/", ".") + "_pb2"


def _ours() -> dict[str, FileProto]:
    """The schema as the committed generated modules hold it, by .proto file name."""
    files = {}
    for proto in generate.proto_files():
        module = importlib.import_module(_module_name(proto))
        files[proto] = FileProto.FromString(module.DESCRIPTOR.serialized_pb)
    return files


@pytest.fixture(scope="module")
def jaxlib_schema() -> dict[str, FileProto]:
    try:
        return embedded.jaxlib_files()
    except embedded.NoEmbeddedSchema as e:
        pytest.fail(f"the installed jaxlib cannot be checked against the IFRT proxy schema: {e}")


def _messages(scope: str, messages) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for msg in messages:
        name = f"{scope}.{msg.name}"
        yield name, msg
        yield from _messages(name, msg.nested_type)


def _enums(fd: FileProto) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto]]:
    pkg = "." + fd.package
    for enum in fd.enum_type:
        yield f"{pkg}.{enum.name}", enum
    for scope, msg in _messages(pkg, fd.message_type):
        for enum in msg.enum_type:
            yield f"{scope}.{enum.name}", enum


def _oneof(msg: descriptor_pb2.DescriptorProto, field) -> Optional[str]:
    return msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None


def _packed(field) -> Optional[bool]:
    return field.options.packed if field.options.HasField("packed") else None


def differences(ours: FileProto, theirs: FileProto) -> list[str]:
    """Every way ``ours`` is not a subset of ``theirs`` (two descriptors of one .proto file)."""
    out = []
    where = ours.name
    for attr in ("package", "syntax"):
        if getattr(ours, attr) != getattr(theirs, attr):
            out.append(f"{where}: {attr} {getattr(ours, attr)!r} != jaxlib's {getattr(theirs, attr)!r}")
    out += [f"{where}: imports {d}, which jaxlib's does not" for d in ours.dependency
            if d not in theirs.dependency]
    pkg = "." + ours.package
    their_msgs = dict(_messages(pkg, theirs.message_type))
    for name, msg in _messages(pkg, ours.message_type):
        other = their_msgs.get(name)
        if other is None:
            out.append(f"{name}: no such message in jaxlib's {where}")
            continue
        if msg.options.map_entry != other.options.map_entry:
            out.append(f"{name}: map entry {msg.options.map_entry} != jaxlib's {other.options.map_entry}")
        their_fields = {f.name: f for f in other.field}
        for field in msg.field:
            theirs_f = their_fields.get(field.name)
            if theirs_f is None:
                out.append(f"{name}.{field.name}: no such field in jaxlib")
                continue
            for attr in _FIELD_ATTRS:
                if getattr(field, attr) != getattr(theirs_f, attr):
                    out.append(f"{name}.{field.name}: {attr} {getattr(field, attr)!r} != jaxlib's "
                               f"{getattr(theirs_f, attr)!r}")
            if _oneof(msg, field) != _oneof(other, theirs_f):
                out.append(f"{name}.{field.name}: oneof {_oneof(msg, field)} != jaxlib's "
                           f"{_oneof(other, theirs_f)}")
            if _packed(field) != _packed(theirs_f):
                out.append(f"{name}.{field.name}: packed {_packed(field)} != jaxlib's {_packed(theirs_f)}")
    their_enums = dict(_enums(theirs))
    for name, enum in _enums(ours):
        other = their_enums.get(name)
        if other is None:
            out.append(f"{name}: no such enum in jaxlib's {where}")
            continue
        values = {v.name: v.number for v in other.value}
        out += [f"{name}.{v.name} = {v.number}: jaxlib's is {values.get(v.name)}"
                for v in enum.value if values.get(v.name) != v.number]
    their_services = {s.name: {m.name: m for m in s.method} for s in theirs.service}
    for service in ours.service:
        methods = their_services.get(service.name)
        if methods is None:
            out.append(f"{pkg}.{service.name}: no such service in jaxlib's {where}")
            continue
        for method in service.method:
            other = methods.get(method.name)
            if other is None:
                out.append(f"{pkg}.{service.name}.{method.name}: no such method in jaxlib")
                continue
            for attr in ("input_type", "output_type", "client_streaming", "server_streaming"):
                if getattr(method, attr) != getattr(other, attr):
                    out.append(f"{pkg}.{service.name}.{method.name}: {attr} {getattr(method, attr)!r} "
                               f"!= jaxlib's {getattr(other, attr)!r}")
    return out


# What the schema (jaxlib 0.10's) holds that newer jaxlib releases dropped: the sharding
# kind by ShardingParam, which only older clients send. Absent from a newer jaxlib, it is
# still served; any other difference is a protocol change to look at.
_SCHEMA_RELEASE = (0, 10)
_RETIRED_FILES = {"xla/python/ifrt/ir/sharding_param.proto"}
_RETIRED = {
    "xla/python/ifrt/sharding_serdes.proto: imports xla/python/ifrt/ir/sharding_param.proto, which jaxlib's does not",
    ".xla.ifrt.ShardingParamShardingProto: no such message in jaxlib's xla/python/ifrt/sharding_serdes.proto",
}


def _jaxlib_release() -> tuple[int, int]:
    import jaxlib

    major, minor = jaxlib.__version__.split(".")[:2]
    return int(major), int(minor)


def test_schema_is_a_subset_of_the_installed_jaxlibs(jaxlib_schema: dict[str, FileProto]) -> None:
    ours = _ours()
    assert "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto" in ours
    newer = _jaxlib_release() > _SCHEMA_RELEASE
    missing = sorted(set(ours) - set(jaxlib_schema) - (_RETIRED_FILES if newer else set()))
    assert not missing, f"the installed jaxlib embeds none of {missing}; its protocol moved them"
    problems = [p for name, fd in sorted(ours.items()) if name in jaxlib_schema
                for p in differences(fd, jaxlib_schema[name]) if not (newer and p in _RETIRED)]
    assert not problems, ("the IFRT proxy schema in pathways/ifrt/schema differs from the installed "
                          "jaxlib's (update the .proto files, see `python -m pathways.ifrt.schema "
                          "print FILE`, and regenerate):\n" + "\n".join(problems))


def test_the_comparison_reports_each_kind_of_difference(jaxlib_schema: dict[str, FileProto]) -> None:
    name = "xla/python/ifrt_proxy/common/ifrt_service.proto"
    ours = _ours()[name]
    theirs = jaxlib_schema[name]
    assert differences(ours, theirs) == []

    def changed(edit) -> list[str]:
        copy = FileProto()
        copy.CopyFrom(ours)
        edit(copy)
        return differences(copy, theirs)

    def msg(fd: FileProto, wanted: str) -> descriptor_pb2.DescriptorProto:
        return next(m for m in fd.message_type if m.name == wanted)

    def field(fd: FileProto, message: str, wanted: str):
        return next(f for f in msg(fd, message).field if f.name == wanted)

    def set_attr(message, name, attr, value):
        return lambda fd: setattr(field(fd, message, name), attr, value)

    assert changed(set_attr("IfrtRequest", "init_request", "number", 99)) == [
        ".xla.ifrt.proxy.IfrtRequest.init_request: number 99 != jaxlib's 2"]
    assert "type" in changed(set_attr("CheckValueReadyRequest", "value_handles", "type",
                                      descriptor_pb2.FieldDescriptorProto.TYPE_BYTES))[0]
    assert "label" in changed(set_attr("IfrtRequest", "init_request", "label",
                                       descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED))[0]
    assert "type_name" in changed(set_attr("IfrtRequest", "init_request", "type_name",
                                           ".xla.ifrt.proxy.InitResponse"))[0]
    assert "no such field" in changed(set_attr("IfrtRequest", "init_request", "name", "x"))[0]
    assert "packed" in changed(lambda fd: field(fd, "CheckValueReadyRequest", "value_handles")
                               .options.ClearField("packed"))[0]
    assert "oneof" in changed(lambda fd: field(fd, "IfrtRequest", "init_request")
                              .ClearField("oneof_index"))[0]
    assert "no such message" in changed(lambda fd: setattr(msg(fd, "InitRequest"), "name", "Nope"))[0]
    status = _ours()["xla/tsl/protobuf/error_codes.proto"]
    bad = FileProto()
    bad.CopyFrom(status)
    bad.enum_type[0].value[1].number = 77
    assert "jaxlib's is" in differences(bad, jaxlib_schema[status.name])[0]


def test_service_methods_are_checked(jaxlib_schema: dict[str, FileProto]) -> None:
    name = "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto"
    bad = FileProto()
    bad.CopyFrom(_ours()[name])
    bad.service[0].method[1].server_streaming = False
    assert differences(bad, jaxlib_schema[name]) == [
        ".xla.ifrt.proxy.GrpcIfrtService.IfrtSession: server_streaming False != jaxlib's True"]


def test_a_library_without_descriptors_is_an_error_not_a_pass(tmp_path: Path) -> None:
    lib = tmp_path / "libjax_common.so"
    lib.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    with pytest.raises(embedded.NoEmbeddedSchema, match="embeds no protobuf file descriptors"):
        embedded.jaxlib_files(str(lib))
    with pytest.raises(embedded.NoEmbeddedSchema, match="cannot read"):
        embedded.jaxlib_files(str(tmp_path / "absent.so"))


def test_every_proto_file_has_its_module_and_no_module_lacks_one() -> None:
    protos = generate.proto_files()
    root = generate.OUTPUT_DIR
    modules = sorted(p.relative_to(root).as_posix()[:-len("_pb2.py")] + ".proto"
                     for p in root.rglob("*_pb2.py"))
    assert modules == protos
    for proto, fd in _ours().items():
        assert fd.name == proto
        for dep in fd.dependency:  # every import resolves to a generated module or protobuf's own
            assert dep in protos or dep.startswith("google/protobuf/"), f"{proto} imports {dep}"


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    try:
        fresh = generate.generate(tmp_path)
    except generate.GrpcToolsMismatch as e:
        pytest.skip(f"cannot regenerate to compare (grpcio-tools is not a test dependency): {e}")
    committed = sorted(p for p in generate.OUTPUT_DIR.rglob("*.py"))
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(generate.OUTPUT_DIR)
                                                        for p in committed]
    stale = [str(p.relative_to(tmp_path)) for p, q in zip(fresh, committed)
             if p.read_bytes() != q.read_bytes()]
    assert not stale, f"generated modules out of date with the .proto files: {stale}; run " \
                      f"`python -m pathways.ifrt.schema`"


def test_compile_options_subset_reads_the_device_assignment_and_keeps_the_rest() -> None:
    import numpy as np
    from jaxlib import xla_client

    from pathways.proto.xla.python.pjrt_ifrt import xla_compiler_pb2

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = 1, 2
    build.use_spmd_partitioning = build.use_shardy_partitioner = True
    build.device_assignment = xla_client.DeviceAssignment.create(np.array([[3, 1]]))
    options.parameter_is_tupled_arguments = True  # a field the subset leaves out
    options.env_option_overrides = [("xla_cpu_enable_fast_math", False)]
    raw = options.SerializeAsString()

    wrapped = xla_compiler_pb2.XlaCompileOptionsProto()
    wrapped.compile_options.ParseFromString(raw)
    wrapped = xla_compiler_pb2.XlaCompileOptionsProto.FromString(wrapped.SerializeToString())
    got = wrapped.compile_options.executable_build_options
    assert (got.num_replicas, got.num_partitions) == (1, 2)
    assert got.use_spmd_partitioning and got.use_shardy_partitioner
    assert got.device_assignment.computation_count == 2
    assert [c.replica_device_ids[0] for c in got.device_assignment.computation_devices] == [3, 1]
    again = xla_client.CompileOptions.ParseFromString(wrapped.compile_options.SerializeToString())
    assert again.SerializeAsString() == raw  # the fields the subset omits survived re-serialization
    assert again.parameter_is_tupled_arguments


def test_print_shows_a_file_as_jaxlib_embeds_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert schema_main(["print", "xla/python/ifrt/device.proto"]) == 0
    text = capsys.readouterr().out
    ours = (generate.SCHEMA_DIR / "xla/python/ifrt/device.proto").read_text()
    assert text.strip() in ours  # ours is jaxlib's, printed the same way, under a header comment
    assert schema_main(["print", "ifrt/device.proto"]) == 1
    assert "did you mean ['xla/python/ifrt/device.proto']" in capsys.readouterr().err
