"""The ``pathways`` command line (``python -m pathways``, the ``pathways`` script): one module
of this package per command.

A command's module has

- a docstring that is the command's help: its first paragraph, "``pathways NAME``: what it
  does.", gives the line ``pathways --help`` lists it with, and the paragraphs after it are
  what ``pathways NAME --help`` says of it (prose, refilled to the terminal's width; an
  indented paragraph, an example, as written);
- ``add_arguments(parser)``: adds its arguments and flags to its parser;
- ``run(parser, args) -> int``: does the command with the parsed ``args`` and returns the
  exit status; ``parser`` is its own parser, for ``parser.error``.

Every call builds every command's parser, so a module's top-level imports stay light: what
the command's work needs (JAX, the client, a cluster) is imported inside ``run``.
Adding a command: a new module here, and its name in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import signal
import sys

from pathways import config

# The commands in the order `pathways --help` lists them: each is the module of that name.
COMMANDS = ("controller", "worker", "up", "run", "status", "retire", "demo", "bench", "spmd", "plan", "trace")


def parser() -> argparse.ArgumentParser:
    """The command line's parser: a subparser per command, each knowing its module's ``run``."""
    top = argparse.ArgumentParser(prog="pathways", description=f"The pathways command line: {', '.join(COMMANDS)}.")
    top.add_argument("--log-level", type=str.lower, choices=config.LOG_LEVELS,
                     default=(config.LOG_LEVEL.text() or config.LOG_LEVEL.default).lower(),
                     help="what this process and the processes it starts (a local cluster's controller and "
                          f"workers) log on stderr (default: ${config.LOG_LEVEL.name}, else "
                          f"{config.LOG_LEVEL.default})")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        doc = module.__doc__ or ""  # python -OO strips docstrings: the commands without their help then
        summary, _, description = inspect.cleandoc(doc).partition("\n\n")
        one_line = " ".join(summary.partition("``: ")[2].split()).removesuffix(".")
        command = commands.add_parser(name, help=one_line, description=description, formatter_class=_Paragraphs)
        module.add_arguments(command)
        command.set_defaults(run=module.run, parser=command)
    return top


class _Paragraphs(argparse.HelpFormatter):
    """Fills each paragraph of a description to the terminal's width, as argparse fills a
    description that is one paragraph, and shows an indented paragraph as it is written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n\n".join(paragraph if paragraph.startswith(" ") else fill(paragraph, width, indent)
                           for paragraph in text.split("\n\n"))


def main(argv: list[str] | None = None) -> int:
    """Run the command of ``argv`` (default: this process's arguments); its exit status."""
    try:
        return _main(argv)
    except SystemExit as e:  # argparse's help (0) and usage errors (2): a status, also when called in-process
        if e.code is not None and not isinstance(e.code, int):
            raise
        return e.code or 0
    except BrokenPipeError:  # stdout closed early (`pathways status | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit flush cannot fail
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    from pathways.wire.security import SecurityConfigError

    args = parser().parse_args(argv)
    # Child processes (a local cluster's controller and workers) log at the same level.
    os.environ[config.LOG_LEVEL.name] = args.log_level
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    try:
        return args.run(args.parser, args)
    except SecurityConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
