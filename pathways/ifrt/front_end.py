"""The IFRT proxy server beside a controller, in the controller's process.

``pathways controller --ifrt-bind`` (and so every local cluster with an IFRT port) hands
``start`` to the controller's server, which calls it once it serves and stops what it
returns before it stops itself. The front end's sessions are clients of that controller:
their streams open without gRPC (``ControllerServer.open_local``) and their arrays go
straight to the workers' data listeners (``Membership.data_routes``). The controller
package imports nothing of this one; the command line joins them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pathways.wire import allocator, tcp
from pathways.wire.security import Security

if TYPE_CHECKING:
    from pathways.controller.server import ControllerServer
    from pathways.ifrt.server import IfrtServer


def start(address: str, bind: str, controller: "ControllerServer") -> "IfrtServer":
    """An IFRT proxy server serving on ``bind``, in front of ``controller`` (at ``address``).
    Raises SystemExit with a message where it cannot listen. Runs off the controller's event
    loop: the server's sessions talk to it."""
    from pathways.ifrt.server import IfrtServer  # imports JAX: only controllers that serve IFRT pay for it

    allocator.keep_message_memory()  # the front end receives array bytes as 1 MiB messages
    security = front_end_security(controller.security)
    data_plane = tcp.Pool(controller.core.membership.data_routes.get, controller.heartbeat_timeout, security)
    server = IfrtServer(address, bind, security, open_local=controller.open_local, data_plane=data_plane)
    try:
        server.start()
    except Exception as e:  # whatever stopped it from serving (a port in use, a bad address): say so and exit
        try:
            server.stop(0)  # whatever part of it started
        except Exception:  # noqa: BLE001 - the process exits with the first error
            pass
        raise SystemExit(f"error: the IFRT proxy server cannot listen on --ifrt-bind {bind}: "
                         f"{type(e).__name__}: {e}") from None
    return server


def front_end_security(security: Security) -> Security:
    """The IFRT proxy server's settings: the cluster's token, and its CA to reach the
    controller and workers with, but no certificate to serve with: JAX's proxy client
    speaks plain gRPC (or ALTS), never TLS, so its port serves plain gRPC."""
    return dataclasses.replace(security, tls_cert=None, tls_key=None, data_plane_tls=False)
