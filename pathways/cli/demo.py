"""``pathways demo``: run the paper's Figure 2 program.

Run the paper's Figure 2 program (three slices, one @pw.program) on the cluster at --address
or $PATHWAYS_ADDRESS, else on an embedded local cluster.
"""

from __future__ import annotations

import argparse
import sys

from pathways.errors import PathwaysError
from pathways.wire import security


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, metavar="grpc://HOST:PORT",
                        help="a running cluster's controller (default: $PATHWAYS_ADDRESS, else an embedded "
                             "local cluster, started and stopped by the demo)")
    security.add_flags(parser, server=False)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.client.session import EMBEDDED_ADVICE
    from pathways.demo import figure2

    # the flags only: pw.connect reads PATHWAYS_TOKEN and PATHWAYS_TLS_CA itself, and
    # applies the CA only to a cluster at an address
    token = security.read_token_file(args.token_file) if args.token_file else None
    try:
        figure2(args.address, token, args.tls_ca)
    except PathwaysError as e:  # a cluster that cannot be reached or refuses the token: one line, like status
        message = str(e).replace(EMBEDDED_ADVICE, "or run `pathways demo` without --address (and with "
                                                  "PATHWAYS_ADDRESS unset) to start an embedded one")
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0
