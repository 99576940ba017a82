"""Print a FileDescriptorProto as .proto source.

Used to read the schema a jaxlib embeds (``python -m pathways.ifrt.schema print FILE``) and to
update the subsets under this directory when jaxlib's protocol changes. It prints what decides
the wire format and the generated Python API (names, numbers, types, labels, oneofs, maps,
proto3 ``optional``, ``packed``, reserved ranges); file and message options are left out: the
generated Python code does not depend on them.
"""

from google.protobuf import descriptor_pb2

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    _FDP.TYPE_DOUBLE: "double", _FDP.TYPE_FLOAT: "float", _FDP.TYPE_INT64: "int64",
    _FDP.TYPE_UINT64: "uint64", _FDP.TYPE_INT32: "int32", _FDP.TYPE_FIXED64: "fixed64",
    _FDP.TYPE_FIXED32: "fixed32", _FDP.TYPE_BOOL: "bool", _FDP.TYPE_STRING: "string",
    _FDP.TYPE_BYTES: "bytes", _FDP.TYPE_UINT32: "uint32", _FDP.TYPE_SFIXED32: "sfixed32",
    _FDP.TYPE_SFIXED64: "sfixed64", _FDP.TYPE_SINT32: "sint32", _FDP.TYPE_SINT64: "sint64",
}
_MAX_FIELD = 536870912  # one past the largest field number: a reserved range ending here is "to max"


def _type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    # Fully qualified with the leading dot: never resolved against an enclosing scope.
    return field.type_name if field.type_name else _SCALARS[field.type]


def _field_options(field: descriptor_pb2.FieldDescriptorProto) -> str:
    opts = []
    if field.options.HasField("packed"):
        opts.append(f"packed = {str(field.options.packed).lower()}")
    if field.options.deprecated:
        opts.append("deprecated = true")
    return f" [{', '.join(opts)}]" if opts else ""


def _reserved(ranges, names, inclusive_end: bool, pad: str) -> list[str]:
    lines = []
    for r in ranges:
        end = r.end if inclusive_end else r.end - 1
        if not inclusive_end and r.end == _MAX_FIELD:
            lines.append(f"{pad}reserved {r.start} to max;")
        elif end == r.start:
            lines.append(f"{pad}reserved {r.start};")
        else:
            lines.append(f"{pad}reserved {r.start} to {end};")
    if names:
        lines.append(f"{pad}reserved " + ", ".join(f"\"{n}\"" for n in names) + ";")
    return lines


def _enum(enum: descriptor_pb2.EnumDescriptorProto, depth: int) -> list[str]:
    pad = "  " * depth
    lines = [f"{pad}enum {enum.name} {{"]
    if enum.options.allow_alias:
        lines.append(f"{pad}  option allow_alias = true;")
    lines += _reserved(enum.reserved_range, enum.reserved_name, True, pad + "  ")
    for value in enum.value:
        dep = " [deprecated = true]" if value.options.deprecated else ""
        lines.append(f"{pad}  {value.name} = {value.number}{dep};")
    return lines + [f"{pad}}}"]


def _message(msg: descriptor_pb2.DescriptorProto, depth: int) -> list[str]:
    pad = "  " * depth
    lines = [f"{pad}message {msg.name} {{"]
    lines += _reserved(msg.reserved_range, msg.reserved_name, False, pad + "  ")
    entries = {n.name: n for n in msg.nested_type if n.options.map_entry}
    for nested in msg.nested_type:
        if not nested.options.map_entry:
            lines += _message(nested, depth + 1)
    for enum in msg.enum_type:
        lines += _enum(enum, depth + 1)
    oneof_open = None
    for field in msg.field:
        in_oneof = field.HasField("oneof_index") and not field.proto3_optional
        if oneof_open is not None and (not in_oneof or field.oneof_index != oneof_open):
            lines.append(f"{pad}  }}")
            oneof_open = None
        if in_oneof and oneof_open is None:
            oneof_open = field.oneof_index
            lines.append(f"{pad}  oneof {msg.oneof_decl[field.oneof_index].name} {{")
        inner = pad + ("    " if in_oneof else "  ")
        entry = entries.get(field.type_name.rsplit(".", 1)[-1]) if field.label == _FDP.LABEL_REPEATED else None
        if entry is not None:
            key, value = entry.field
            decl = f"map<{_type(key)}, {_type(value)}>"
        else:
            label = "repeated " if field.label == _FDP.LABEL_REPEATED else ""
            if field.proto3_optional:
                label = "optional "
            decl = label + _type(field)
        lines.append(f"{inner}{decl} {field.name} = {field.number}{_field_options(field)};")
    if oneof_open is not None:
        lines.append(f"{pad}  }}")
    return lines + [f"{pad}}}"]


def _service(service: descriptor_pb2.ServiceDescriptorProto) -> list[str]:
    lines = [f"service {service.name} {{"]
    for m in service.method:
        cin = "stream " if m.client_streaming else ""
        cout = "stream " if m.server_streaming else ""
        lines.append(f"  rpc {m.name}({cin}{m.input_type}) returns ({cout}{m.output_type});")
    return lines + ["}"]


def to_proto(fd: descriptor_pb2.FileDescriptorProto, header: str = "") -> str:
    """``fd`` as .proto source; ``header`` (comment lines without ``//``) goes first."""
    if fd.syntax != "proto3":
        raise ValueError(f"{fd.name} is not proto3 (syntax {fd.syntax or 'proto2'!r}): only proto3 "
                         f"files, which the IFRT proxy's all are, print as .proto")
    lines = [f"// {line}".rstrip() for line in header.splitlines()]
    if lines:
        lines.append("")
    lines.append('syntax = "proto3";')
    lines.append("")
    if fd.package:
        lines += [f"package {fd.package};", ""]
    if fd.dependency:
        lines += [f'import "{dep}";' for dep in fd.dependency] + [""]
    blocks = [_enum(e, 0) for e in fd.enum_type] + [_message(m, 0) for m in fd.message_type]
    blocks += [_service(s) for s in fd.service]
    for block in blocks:
        lines += block + [""]
    return "\n".join(lines).rstrip() + "\n"
