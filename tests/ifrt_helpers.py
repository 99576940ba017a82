"""Running unmodified JAX scripts under JAX_PLATFORMS=proxy against an IfrtServer."""

import json
import os
import subprocess
import sys
import textwrap

from pathways.cluster import stop_processes

# The backend registration pathwaysutils.initialize() does (an installed pathways does it
# through its jax_plugins entry point; these tests run the package uninstalled); what
# follows it is an unmodified JAX program.
PRELUDE = """
import jax
from jax.extend import backend
from jax.extend.backend import ifrt_proxy

def _make_client():
    return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), ifrt_proxy.ClientConnectionOptions())

backend.register_backend_factory("proxy", _make_client, priority=-1)
"""


def run_jax(address: str, body: str, timeout: float = 240.0) -> dict:
    """Run ``body`` as a JAX program against the IFRT server at ``address`` (HOST:PORT);
    it reports by printing one JSON line starting with ``RESULT``. Returns that object."""
    env = dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{address}",
               IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_processes([proc])
        out, err = proc.communicate()
        raise AssertionError(f"the JAX client did not finish within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the JAX client failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])
