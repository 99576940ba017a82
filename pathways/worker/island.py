"""A worker's place on the network and in its island: which host it binds and advertises,
the coordinator port it reserves, and JAX's configuration once the controller has said
which rank it is.

The hosts of an island of several hosts form one ``jax.distributed`` group (CPU collectives
over gloo), whose coordination service rank 0 runs. Ranks come from the controller, so JAX
is configured only after the worker has registered and been welcomed: ``configure_jax``
runs then, before anything touches a JAX device.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pathways.platforms import Devices
from pathways.protocol.messages import WorkerWelcome
from pathways.wire.addresses import is_wildcard, join_host_port, route_to, split_host_port, strip_brackets

log = logging.getLogger("pathways.worker")

_COORDINATOR_FIRST_PAUSE, _COORDINATOR_MAX_PAUSE = 0.02, 0.1  # seconds between looks at the coordinator
# How long a host leaving its island's group waits: rank 0 for the others to leave first,
# the others to say they leave. Under the local cluster's grace between SIGTERM and SIGKILL.
LEAVE_SECONDS = 2.0
LEAVE_LINGER_SECONDS = 0.2  # how long rank 0 keeps the service once the others have left it


@dataclass(frozen=True)
class IslandMembership:
    """The island a worker says it belongs to: its name, how many hosts it has, and the
    rank this host asks for (None: the controller gives the next free one)."""

    name: str = "0"
    hosts: int = 1
    rank: Optional[int] = None


def worker_hosts(controller_host: str, controller_port: int, bind: Optional[str], advertise: Optional[str],
                 route: Callable[[str, int], str] = route_to) -> tuple[str, str]:
    """(bind host, advertised host) of a worker whose controller is at
    ``controller_host:controller_port``. ``bind`` defaults to ``advertise``, and both to the
    local address this host uses to reach the controller (``route``): loopback when the
    controller is on this machine, else the address of the interface that faces it. A
    wildcard bind advertises that same route address. Raises OSError when no route leads
    to the controller."""
    if advertise is None and (bind is None or is_wildcard(bind)):
        advertise = route(controller_host, controller_port)
    elif advertise is None:
        advertise = bind
    return strip_brackets(bind if bind is not None else advertise), strip_brackets(advertise)


def configure_jax(devices: Devices, hosts: int, welcome: Optional[WorkerWelcome], bind: str, advertise: str,
                  timeout: float) -> None:
    """Configure JAX for ``devices`` (a platform, and for the CPU how many virtual devices);
    for an island of several hosts, join its jax.distributed group as ``welcome.rank`` (rank
    0 runs the coordination service on ``bind`` at the reserved port), waiting up to
    ``timeout`` seconds for the other hosts."""
    import jax

    from pathways.worker.jax_private import check_version

    check_version()
    # A worker holds, moves and computes every dtype its clients send, bit for bit: whether
    # 64-bit types exist is each client's setting (its arrays and programs arrive typed), so
    # the worker's JAX must never narrow them.
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platforms", devices.platform)
    if devices.kind == "cpu":
        jax.config.update("jax_num_cpu_devices", devices.count)
    if hosts == 1 or welcome is None:
        return
    # A lost host is the controller's to handle (it fails the island's work and stops
    # the other hosts); without this, jax aborts every other process of the group.
    jax.config.update("jax_enable_recoverability", True)
    if devices.kind == "cpu":
        # Collectives between CPU devices of several hosts; accelerators bring their own (NCCL, ICI).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _gloo_on(advertise if is_wildcard(bind) else bind)
    port = split_host_port(welcome.coordinator)[1]
    # jax's coordinator binds every address of the machine ([::]:PORT) unless told otherwise
    service = join_host_port(bind, port) if welcome.rank == 0 else None
    log.info("joining island group as rank %d of %d, coordinator %s", welcome.rank, hosts, welcome.coordinator)
    deadline = time.monotonic() + timeout
    if welcome.rank != 0:
        _wait_for_coordinator(welcome.coordinator, deadline)
    left = deadline - time.monotonic()
    # The preemption service (a sync point for hosts given notice of maintenance) is unused
    # here, and its manager keeps a barrier call open on the coordination service: a host
    # that leaves the group (leave_group) has it cancelled, which it logs as an error.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(welcome.coordinator, hosts, welcome.rank, initialization_timeout=max(1, int(left)),
                               coordinator_bind_address=service)


def _wait_for_coordinator(coordinator: str, deadline: float) -> None:
    """Wait until the coordination service at ``coordinator`` (HOST:PORT) accepts
    connections, until ``deadline`` (monotonic) at most. A host often learns its rank
    before rank 0 runs the service, and JAX's client, refused once, tries again only after
    gRPC's first back-off (1 s); looking with short pauses first costs a few connections
    instead. If it does not come, jax.distributed.initialize waits and reports on its own."""
    host, port = split_host_port(coordinator)
    pause = _COORDINATOR_FIRST_PAUSE
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((strip_brackets(host), port),
                                          timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            time.sleep(pause)
            pause = min(2 * pause, _COORDINATOR_MAX_PAUSE)


def _gloo_on(host: str) -> None:
    """Have gloo's collectives listen on ``host`` and tell peers that address. By default
    gloo resolves the machine's host name, which on many machines (and in network
    namespaces) names an address peers cannot reach, e.g. 127.0.1.1. jax offers no
    setting for it, so the CPU backend's factory is replaced by one that passes it (jax
    internals: jax_private.py)."""
    from pathways.worker.jax_private import gloo_cpu_client, xla_bridge

    def make_cpu_client():  # called once, when JAX first needs its CPU backend
        return gloo_cpu_client(strip_brackets(host))

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def leave_group(timeout: float = LEAVE_SECONDS) -> None:
    """Before a host of an island of several hosts exits on purpose: leave the island's
    jax.distributed group without aborting the others. Rank 0 runs the group's coordination
    service, and every other host that still polls it when it goes away aborts with JAX's
    fatal error (recoverability covers the loss of other hosts, not of rank 0). So the
    others disconnect from the service, and rank 0 waits until they have, or until
    ``timeout`` seconds have passed (a host that is lost never disconnects). Does nothing
    in a process that never joined a group."""
    from pathways.worker.jax_private import distributed

    state = distributed.global_state
    client = state.client
    if client is None:
        return
    if state.process_id == 0:
        def leave() -> None:
            # answers once every other host has disconnected or asked the same (none does)
            client.get_live_nodes(list(range(state.num_processes)))
            # A host's disconnect is answered before it stops polling the service for
            # errors: a service gone in between is such an error, and aborts that host.
            time.sleep(LEAVE_LINGER_SECONDS)
    else:
        leave = client.shutdown

    def run() -> None:
        try:
            leave()
        except Exception as e:  # noqa: BLE001 - the group is going away; the host exits either way
            log.debug("leaving the island's group: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=run, name="pathways-leave-group", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.debug("leaving the island's group did not finish within %g s", timeout)
