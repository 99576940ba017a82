"""``python -m pathways.ifrt.schema``: regenerate ``pathways/proto`` from the .proto files here.

``python -m pathways.ifrt.schema print FILE.proto`` prints that file as the installed jaxlib
embeds it, as .proto source, to update the schema here when jaxlib's protocol changes.
"""

import argparse
import sys

from pathways.ifrt.schema import embedded, generate, printer


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pathways.ifrt.schema", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("print", help="print a .proto file the installed jaxlib embeds")
    show.add_argument("file", help="its path, e.g. xla/python/ifrt_proxy/common/ifrt_service.proto")
    args = parser.parse_args(argv)
    if args.command == "print":
        try:
            files = embedded.jaxlib_files()
        except embedded.NoEmbeddedSchema as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.file not in files:
            near = sorted(n for n in files if n.rsplit("/", 1)[-1] == args.file.rsplit("/", 1)[-1])
            print(f"error: jaxlib embeds no {args.file}" + (f"; did you mean {near}?" if near else
                  "; give a path like xla/xla_data.proto"), file=sys.stderr)
            return 1
        sys.stdout.write(printer.to_proto(files[args.file]))
        return 0
    try:
        written = generate.regenerate()
    except generate.GrpcToolsMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files under {generate.OUTPUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
