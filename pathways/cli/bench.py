"""``pathways bench``: run a benchmark, or all of them (regenerates BENCHMARKS.md).

Run one benchmark, or all of them. Each runs pathways and its baseline alternately, round after
round, on clusters of its own, and prints medians with the spread of the rounds and whether
each target is met; --tiny runs each at its smallest size, to check that it runs. The
benchmarks need the bench extra: pip install ".[bench]" (the solver, plots, TLS certificates,
optax).
"""

from __future__ import annotations

import argparse
import json

from pathways_bench.suite import EXPERIMENTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", choices=[*EXPERIMENTS, "all"],
                        help=f"the benchmark to run: one of {', '.join(EXPERIMENTS)}; or all, to run every one "
                             "and write --out")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating repetitions of each measurement (default: the benchmark's own)")
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes, to check that it runs")
    parser.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (one benchmark)")
    parser.add_argument("--out", default="BENCHMARKS.md", help="all: the markdown file to write")
    parser.add_argument("--plots", default="docs/bench", help="all: the folder for the plots")
    parser.add_argument("--from-json", metavar="PATH",
                        help="all: rewrite the markdown and plots from the JSON of an earlier `bench all --json`")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways_bench import suite

    if args.from_json:
        if args.name != "all":
            parser.error("--from-json redraws BENCHMARKS.md: use it with `bench all`")
        with open(args.from_json) as f:
            suite.render(json.load(f), args.out, args.plots)
    elif args.name == "all":
        suite.run_all(args.rounds, args.tiny, args.out, args.plots, args.json)
    else:
        suite.run(args.name, args.rounds, args.tiny, args.json, args.plot)
    return 0
