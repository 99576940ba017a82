"""The protobuf schema compiled into the installed jaxlib.

jaxlib's C++ protobuf code carries the serialized ``FileDescriptorProto`` of every .proto file it
was built from, in ``jaxlib/libjax_common.so``. Each starts with field 1 (the file's name, ending in
``.proto``); this module finds those byte runs, parses them and returns them by file name. It is
how the tests check our schema against the protocol the installed IFRT proxy client speaks.
"""

import os
import re
from typing import Optional

from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

LIBRARY = "libjax_common.so"

# Wire type of each FileDescriptorProto field (1..15): 0 varint, 2 length-delimited. The scan
# stops at the first key outside this table, which is where the serialized file ends.
_WIRE_TYPES = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2,
               13: 2, 14: 0, 15: 2}
# Field 1 (tag 0x0a), a one-byte length, then a .proto file name of that length.
_START = re.compile(rb"\x0a([\x01-\x7f])([\w/.\-]{1,126}\.proto)")


class NoEmbeddedSchema(RuntimeError):
    """The installed jaxlib carries no protobuf descriptors this module can find."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _extent(data: bytes, start: int) -> bytes:
    """The longest run from ``start`` that is a sequence of well-typed FileDescriptorProto fields."""
    i = start
    while i < len(data):
        try:
            key, j = _varint(data, i)
            if _WIRE_TYPES.get(key >> 3) != key & 7:
                break
            length, j = _varint(data, j)
        except IndexError:
            break
        if key & 7 == 2:
            j += length
            if j > len(data):
                break
        i = j
    return data[start:i]


def library_path() -> str:
    """Where the installed jaxlib's ``libjax_common.so`` is."""
    import jaxlib  # heavy; only the tests and the schema tool need it

    return os.path.join(os.path.dirname(jaxlib.__file__), LIBRARY)


def scan(data: bytes) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Every FileDescriptorProto serialized in ``data``, by file name (the longest run per name)."""
    found: dict[str, tuple[int, descriptor_pb2.FileDescriptorProto]] = {}
    for match in _START.finditer(data):
        if match.group(1)[0] != len(match.group(2)):
            continue
        blob = _extent(data, match.start())
        fd = descriptor_pb2.FileDescriptorProto()
        try:
            fd.ParseFromString(blob)
        except DecodeError:
            continue
        if not (fd.message_type or fd.enum_type or fd.service):
            continue
        # A name can also occur as a string elsewhere; the full descriptor is the longest run.
        if fd.name not in found or len(blob) > found[fd.name][0]:
            found[fd.name] = (len(blob), fd)
    return {name: fd for name, (_, fd) in found.items()}


def jaxlib_files(path: Optional[str] = None) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """The .proto files compiled into jaxlib (``path``: its library; default the installed one).

    Raises NoEmbeddedSchema, saying what to do, when the library is missing or holds none.
    """
    path = path or library_path()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise NoEmbeddedSchema(
            f"cannot read {path} ({e}); this jaxlib build is laid out differently, so the IFRT "
            f"proxy schema cannot be checked against it: pass the library that holds jaxlib's "
            f"protobuf descriptors") from e
    files = scan(data)
    if not files:
        raise NoEmbeddedSchema(
            f"{path} embeds no protobuf file descriptors; this jaxlib build cannot be checked "
            f"against the IFRT proxy schema: use a jaxlib wheel from PyPI, whose library embeds them")
    return files
