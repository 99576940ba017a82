"""Generate ``pathways.proto`` from the .proto files under ``pathways/ifrt/schema``.

protoc's Python output imports a file's dependencies by their .proto path (``from xla.python.ifrt
import dtype_pb2``); the modules live under ``pathways.proto``, so those imports and the
module names recorded in each file are rewritten to that package. The output depends only on the
.proto files and the pinned grpcio-tools, so a test can regenerate and compare.
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent
OUTPUT_DIR = SCHEMA_DIR.parent.parent / "proto"
PACKAGE = "pathways.proto"
# protobuf 6.31.1 gencode, which the runtime range in pyproject.toml accepts (grpcio-tools releases
# that emit protobuf 7 gencode need a runtime ortools does not allow).
GRPC_TOOLS_VERSION = "1.76.0"
ROOT_INIT = ('"""Generated from pathways/ifrt/schema by `python -m pathways.ifrt.schema`; do not '
             'edit."""\n')

_IMPORT = re.compile(r"^from xla(\.| import )", re.MULTILINE)
_MODULE_NAME = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')(xla\.)")


class GrpcToolsMismatch(RuntimeError):
    """grpcio-tools is missing or is not the version the committed modules were generated with."""


def proto_files() -> list[str]:
    """The schema's .proto files, relative to SCHEMA_DIR, sorted."""
    return sorted(p.relative_to(SCHEMA_DIR).as_posix() for p in SCHEMA_DIR.rglob("*.proto"))


def _grpc_tools() -> Path:
    """The installed grpc_tools package's directory, checked to be GRPC_TOOLS_VERSION. Not
    imported here: protoc runs in a child process (see generate)."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    try:
        found = version("grpcio-tools")
        spec = find_spec("grpc_tools")
    except PackageNotFoundError as e:
        spec, found = None, str(e)
    if spec is None or spec.origin is None:
        raise GrpcToolsMismatch(
            f"grpcio-tools is not installed ({found}): pip install grpcio-tools=={GRPC_TOOLS_VERSION}")
    if found != GRPC_TOOLS_VERSION:
        raise GrpcToolsMismatch(
            f"grpcio-tools {found} is installed; the modules are generated with {GRPC_TOOLS_VERSION} "
            f"(protobuf 6.31.1 gencode): pip install grpcio-tools=={GRPC_TOOLS_VERSION}")
    return Path(spec.origin).parent


def rewrite(source: str) -> str:
    """protoc's Python module with its ``xla`` imports and module name moved under PACKAGE."""
    source = _IMPORT.sub(rf"from {PACKAGE}.xla\1", source)
    return _MODULE_NAME.sub(rf"\g<1>{PACKAGE}.\2", source)


def generate(out_dir: Path) -> list[Path]:
    """Write the complete ``pathways.proto`` package into the empty ``out_dir``; returns its
    files (modules and ``__init__.py``s), sorted. Raises GrpcToolsMismatch without grpcio-tools
    GRPC_TOOLS_VERSION, RuntimeError when protoc rejects the schema."""
    well_known = _grpc_tools() / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        # In a child process: grpc_tools' compiler extension carries its own protobuf library,
        # which can crash a process that has already loaded jaxlib's and grpc's.
        args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{SCHEMA_DIR}", f"-I{well_known}",
                f"--python_out={raw}"]
        done = subprocess.run(args + proto_files(), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"protoc rejected the schema in {SCHEMA_DIR} (exit {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        written = []
        for src in sorted(Path(raw).rglob("*_pb2.py")):
            dst = out_dir / src.relative_to(raw)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(rewrite(src.read_text()))
            written.append(dst)
    packages = {out_dir} | {p.parent for p in written}
    for path in list(packages):
        while path != out_dir:
            path = path.parent
            packages.add(path)
    for package in packages:
        init = package / "__init__.py"
        init.write_text(ROOT_INIT if package == out_dir else "")
        written.append(init)
    return sorted(written)


def regenerate(out_dir: Path = OUTPUT_DIR) -> list[Path]:
    """Replace ``out_dir`` (default: the package's ``pathways/proto``) with fresh modules."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "proto"
        fresh.mkdir()
        generate(fresh)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.copytree(fresh, out_dir)
    return sorted(p for p in out_dir.rglob("*.py"))
