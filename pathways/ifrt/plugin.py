"""JAX's ``proxy`` backend, registered for unmodified programs through JAX's plugin entry point.

Installed, the package advertises this module under the ``jax_plugins`` entry-point group
(pyproject.toml). JAX imports every such module and calls its ``initialize()`` when it first
looks for backends (``jax.devices()``, the first ``jit``), so that

    JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://HOST:PORT python train.py

runs ``train.py`` unchanged on the pathways cluster whose IFRT proxy server is at HOST:PORT.
``initialize()`` registers the ``proxy`` backend factory only when ``proxy`` is among the
platforms JAX was asked for: every other JAX program on the machine is left as it was.

The factory, when JAX calls it:

- connects with plain gRPC (``IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS=true``, unless the
  environment already says otherwise) for ``grpc://`` targets only: the client's default
  credentials are ALTS, which only Google's servers speak;
- passes ``PATHWAYS_TOKEN`` (the cluster's token, required beyond loopback),
  ``PATHWAYS_SLICE`` (``KIND:COUNT[@ISLAND]``, e.g. ``cpu:2``: the session's devices are one
  slice the cluster places) and ``PATHWAYS_WEIGHT`` (the session's fair-share weight) as the
  session's initialization data, keys ``pathways_token``, ``pathways_slice`` and
  ``pathways_weight``;
- bounds the client's host-buffer transfers in flight at once (``TRANSFER_LIMITS``, unless
  the environment sets them);
- waits ``PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS`` seconds for the server where set (as
  pathwaysutils does), else the client's own bound (2 minutes);
- first asks a ``grpc://`` server whether it would admit the session (``admission``: the
  pathways server's own method), and fails at once with its one-line reason where it would
  not (a missing or wrong token, a slice it cannot place, a bad weight): JAX's client
  retries a refused session for its whole connection timeout;
- has ``jax.profiler`` profile the cluster's workers too (worker_traces.py).

``pathwaysutils.initialize()`` registers a ``proxy`` factory too; whichever registers last
wins while the backend is not yet made, and this one runs last (JAX calls it while making
backends, after the script's own code), so its credentials and initialization data apply.
Once the backend exists, registering again is refused by JAX and ignored here.

This module is imported by every JAX program on a machine where the package is installed:
it does nothing expensive unless ``proxy`` was asked for.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

from pathways import config

log = logging.getLogger("pathways.ifrt.plugin")

PLATFORM = "proxy"
INSECURE_ENV = "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"
TOKEN_KEY = "pathways_token"
SLICE_KEY = "pathways_slice"
WEIGHT_KEY = "pathways_weight"
PLAIN_GRPC = "grpc://"
# The client otherwise opens a host-buffer store or lookup (a gRPC call and a thread of its
# own) for every array it sends or reads, all at once: a training loop that queues hundreds
# of steps, each putting a batch split over the devices, opens thousands, beyond what a
# server queues before it starts cancelling calls (the client then drops its session). An
# explicit setting wins.
TRANSFER_LIMITS = {"IFRT_PROXY_GRPC_MAX_ONGOING_HOST_BUFFER_STORES": "64",
                   "IFRT_PROXY_GRPC_MAX_ONGOING_HOST_BUFFER_LOOKUPS": "64"}
# pathwaysutils registers with this priority; JAX orders backends by JAX_PLATFORMS anyway
# when it is set, which is the only time this module registers.
_PRIORITY = -1


def requested(platforms: Optional[str]) -> bool:
    """Whether ``platforms`` (JAX_PLATFORMS's form: comma-separated names) names ``proxy``."""
    return PLATFORM in (p.strip() for p in (platforms or "").split(","))


def initialization_data(env: Mapping[str, str]) -> dict[str, bytes]:
    """The session's initialization data from ``env``: the token, slice and weight where set."""
    data = {}
    for key, var in ((TOKEN_KEY, config.TOKEN), (SLICE_KEY, config.SLICE), (WEIGHT_KEY, config.WEIGHT)):
        value = var.text(env)
        if value is not None:
            data[key] = value.encode()
    return data


def connection_timeout(env: Mapping[str, str]) -> Optional[int]:
    """Seconds to wait for the server (PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS), or None for
    the client's default. Raises ValueError naming the variable when it is not a positive
    whole number."""
    return config.PROXY_CONNECTION_TIMEOUT.get(env)


# the pathways IFRT server's own method (server.py serves it): would it admit a session?
ADMISSION_SERVICE, ADMISSION_METHOD = "pathways.IfrtAdmission", "Check"
ADMISSION = f"/{ADMISSION_SERVICE}/{ADMISSION_METHOD}"
ADMISSION_SECONDS = 5.0


def admission(target: str, data: Mapping[str, bytes], timeout: float = ADMISSION_SECONDS) -> Optional[str]:
    """Why the pathways IFRT server at ``target`` (``grpc://HOST:PORT``) would refuse a
    session with initialization ``data``, or None: admitted, or not said (the server is
    not reachable yet, or not a pathways one); the client's own connection then decides."""
    import grpc

    from pathways.errors import WireError
    from pathways.protocol import operator

    channel = grpc.insecure_channel(target.removeprefix(PLAIN_GRPC))
    check = operator.AdmissionCheck({k: v.decode("utf-8", "replace") for k, v in data.items()})
    try:
        answer = channel.unary_unary(ADMISSION)(operator.reply(check), timeout=timeout)
        return operator.answer(operator.ADMISSION_REPLY, answer).refused
    except (grpc.RpcError, WireError) as e:
        log.debug("no admission check at %s (%s); connecting anyway", target, e)
        return None
    finally:
        channel.close()


def make_client() -> Any:
    """The ``proxy`` backend: an IFRT proxy client connected to JAX_BACKEND_TARGET."""
    import jax
    from jax.extend.backend import ifrt_proxy

    target = jax.config.read("jax_backend_target") or ""
    if not target:
        raise ValueError("JAX_PLATFORMS names 'proxy' but no server is given: set JAX_BACKEND_TARGET=grpc://HOST:PORT "
                         "(the address `python -m pathways up --ifrt-port PORT` prints)")
    if target.startswith(PLAIN_GRPC):
        # read by the client when it connects, in this process; an explicit setting wins
        os.environ.setdefault(INSECURE_ENV, "true")
    for name, value in TRANSFER_LIMITS.items():  # read once, when the first client is made
        os.environ.setdefault(name, value)
    options = ifrt_proxy.ClientConnectionOptions()
    timeout = connection_timeout(os.environ)
    if timeout is not None:
        options.connection_timeout_in_seconds = timeout
    data = initialization_data(os.environ)
    if target.startswith(PLAIN_GRPC):
        refused = admission(target, data)
        if refused is not None:
            raise RuntimeError(f"the pathways IFRT server at {target} refused this program's session: {refused}")
    if data:
        options.initialization_data = data
    client = ifrt_proxy.get_client(target, options)
    from pathways.ifrt import worker_traces

    worker_traces.install()  # jax.profiler profiles the workers too
    return client


def initialize() -> None:
    """JAX's plugin hook: register the ``proxy`` backend factory if ``proxy`` was asked for
    (JAX_PLATFORMS, or the jax_platforms setting)."""
    import jax

    if not (requested(os.environ.get("JAX_PLATFORMS")) or requested(jax.config.jax_platforms)):
        return
    from jax.extend import backend

    try:
        backend.register_backend_factory(PLATFORM, make_client, priority=_PRIORITY)
    except RuntimeError as e:  # "Backend proxy already initialized": whoever made it stays
        log.debug("the proxy backend exists already; not registering it again: %s", e)
