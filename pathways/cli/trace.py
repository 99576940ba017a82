"""``pathways trace``: summarize a timeline file (pw.trace, PATHWAYS_TRACE); draw it with --png.

Summarize a timeline that pw.trace or PATHWAYS_TRACE wrote: per step, its count, total and
median; per function, its runs and compiles. With --png, draw it as a Gantt chart.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the timeline's Chrome trace-event JSON")
    parser.add_argument("--png", metavar="PATH", help="write a Gantt chart: a row per process and thread")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.timeline_view import TimelineFileError, gantt, load, summary

    try:
        spans = load(args.file)
    except TimelineFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(spans))
    if args.png:
        gantt(spans, args.png, f"pathways timeline: {os.path.basename(args.file)}")
        print(f"wrote {args.png}")
    return 0
