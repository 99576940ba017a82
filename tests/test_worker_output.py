"""What a worker shows on the terminal at the default log level: gloo's connection notices
on its stdout become log records at info (pathways/worker/native_stdout.py), and its C++
logs (XLA, the coordination service it may host) show errors only, however it was started."""

import os
import subprocess
import sys

import pytest

from pathways import keeper

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


@pytest.mark.parametrize("level, cpp, grpc", [("warning", "2", "ERROR"), ("error", "2", "ERROR"),
                                              ("info", "0", "INFO"), ("DEBUG", "0", "INFO")])
def test_the_keeper_gives_its_worker_the_cpp_and_grpc_log_levels_of_its_log_level(level, cpp, grpc):
    # as `pathways worker` started by hand runs it: PATHWAYS_LOG_LEVEL from --log-level,
    # TF_CPP_MIN_LOG_LEVEL=1 as JAX leaves it on import (warnings shown) in the process it
    # replaces, and a GRPC_VERBOSITY of the user's
    env = {**os.environ, keeper.LOG_LEVEL_ENV: level, keeper.CPP_LOG_LEVEL_ENV: "1", keeper.GRPC_VERBOSITY_ENV: "DEBUG"}
    env.pop(keeper.PARENT_PID_ENV, None)
    worker = [sys.executable, "-c", f"import os; print(os.environ[{keeper.CPP_LOG_LEVEL_ENV!r}], "
                                    f"os.environ[{keeper.GRPC_VERBOSITY_ENV!r}])"]
    out = subprocess.run(keeper.command(1.0, worker), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [cpp, grpc]


def test_the_keeper_says_which_signal_ended_its_worker():
    # a SIGKILL (the kernel's OOM killer, an operator) leaves the worker no chance to say anything
    env = {k: v for k, v in os.environ.items() if k != keeper.PARENT_PID_ENV}
    worker = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    out = subprocess.run(keeper.command(1.0, worker), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + 9, out.stderr
    assert "pathways worker: the worker (pid " in out.stderr and ") was ended by SIGKILL" in out.stderr, out.stderr
