"""Notices that C++ libraries print on a worker's stdout, kept off the user's terminal.

gloo, which runs the CPU collectives of an island's jax.distributed group, prints
``[Gloo] Rank 0 is connected to 3 peer ranks. ...`` on stdout whenever a group's first
collective connects its ranks, whatever any log level says (no setting of gloo's silences
it). A local cluster sends its workers' stdout to the user's stderr, so every ``pathways
run`` of a program with collectives printed one line per host. ``filter_stdout`` routes
the process's fd 1 through a pipe: such notices become log records at info (shown at
``--log-level info``), every other line goes on to where fd 1 went.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading

# Only the connection notice: anything else gloo prints (errors included) passes unchanged.
NOTICE = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\b")
_DRAIN_SECONDS = 1.0  # at exit, how long the lines already written have to reach their destination


def forward(line: bytes, out_fd: int, log: logging.Logger) -> None:
    """Pass ``line`` on to ``out_fd``, or log it at info when it is a library notice."""
    if NOTICE.match(line):
        log.info("%s", line.decode(errors="replace").rstrip())
    else:
        os.write(out_fd, line)


def filter_stdout(log: logging.Logger) -> None:
    """From now on, what this process (and its C++ libraries) writes to fd 1 passes
    through ``forward`` on a daemon thread. At exit fd 1 is put back, which ends the pipe,
    and the thread is given a moment to pass on what is left."""
    out_fd = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.close(write_fd)

    def pump() -> None:
        shown = True
        with os.fdopen(read_fd, "rb") as pipe:
            for line in pipe:
                if shown:
                    try:
                        forward(line, out_fd, log)
                    except OSError:  # where fd 1 went is closed: read on, so that writers never block
                        shown = False

    thread = threading.Thread(target=pump, name="native-stdout", daemon=True)
    thread.start()

    def restore() -> None:
        try:
            sys.stdout.flush()
            os.dup2(out_fd, 1)  # closes the pipe's last writer: the thread reads to its end
        except (OSError, ValueError):  # a stdout closed already, or fd 1 gone
            return
        thread.join(_DRAIN_SECONDS)

    atexit.register(restore)
