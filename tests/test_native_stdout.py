"""A worker's stdout passes through a filter that turns gloo's connection notices into log
records at info and passes every other line on (pathways/worker/native_stdout.py)."""

import subprocess
import sys

import pytest

NOTICE = "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
# A process that installs the filter, then writes as a C++ library does (straight to fd 1)
# and as Python does (sys.stdout, flushed at exit).
PROGRAM = f"""
import logging, os, sys
logging.basicConfig(level=sys.argv[1].upper(), format="%(levelname)s %(message)s")
from pathways.worker.native_stdout import filter_stdout
filter_stdout(logging.getLogger("pathways.worker"))
os.write(1, b"{NOTICE}\\n")
os.write(1, b"[Gloo] an error gloo reports\\n")
print("the program's own line")
"""


@pytest.mark.parametrize("level", ["warning", "info"])
def test_gloo_connection_notices_are_logged_at_info_and_other_lines_pass(level):
    out = subprocess.run([sys.executable, "-c", PROGRAM, level], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[Gloo] an error gloo reports", "the program's own line"]
    assert (f"INFO {NOTICE}" in out.stderr) == (level == "info"), out.stderr
