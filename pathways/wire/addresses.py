"""Host and port handling shared by every process: which host a server binds, and which
host it tells its peers.

A server binds one host (``--bind``) and advertises a host its peers can reach: the same
one, unless the bind host is a wildcard (0.0.0.0 or ::, every address of the machine), in
which case no single address follows from it and the process must pick one. A worker
advertises by default the local address it uses to reach its controller (the source
address the kernel picks for a route to the controller: ``route_to``), which on one machine
is loopback and across machines is the address of the interface that faces the controller.
IPv6 literals are written in brackets wherever a port follows them (``[::1]:50051``).
"""

from __future__ import annotations

import ipaddress
import socket
import struct

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
# A documentation address (RFC 5737): ``reachable_host`` "connects" a UDP socket to it to
# learn which interface the default route uses; a UDP connect sends no packet.
_ROUTE_PROBE = ("192.0.2.1", 9)
_ROUTE_PROBE_V6 = ("2001:db8::1", 9)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def strip_brackets(host: str) -> str:
    """``[::1]`` -> ``::1``; other hosts unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(strip_brackets(host)).version == 6
    except ValueError:
        return False


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 literal in brackets."""
    host = strip_brackets(host)
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def split_host_port(target: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) -> (host without brackets, port). Raises ValueError
    naming what is wrong."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{target!r} is not of the form HOST:PORT (e.g. 127.0.0.1:50051 or [::1]:50051)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{target!r}: write an IPv6 address in brackets, e.g. [::1]:50051")
    return strip_brackets(host), int(port)


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every address of the machine."""
    return strip_brackets(host) in WILDCARDS


def family_of(host: str) -> socket.AddressFamily:
    """The address family to bind ``host`` with (host names: IPv4)."""
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def route_to(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port`` (resolving a host name):
    the source address of a UDP socket connected there, which sends nothing. Raises
    OSError when ``host`` does not resolve or no route leads there."""
    infos = socket.getaddrinfo(strip_brackets(host), port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def unreachable(host: str, port: int, timeout: float = 2.0) -> str | None:
    """Why a TCP connection to ``host:port`` cannot be made, said with what to check: the
    name does not resolve, the connection is refused, or nothing answers within ``timeout``
    seconds (host down or cut off, or a firewall that drops it); None when it can be made."""
    try:
        infos = socket.getaddrinfo(strip_brackets(host), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host name {host!r} does not resolve ({e.strerror}); check its spelling, or give an IP address"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout)
        try:
            s.connect(sockaddr)
        except ConnectionRefusedError:
            return (f"the connection was refused: {host} answers, but nothing listens on port {port}; check the "
                    "port, and that the server runs")
        except TimeoutError:
            return (f"nothing answered: a TCP connection to {sockaddr[0]} port {port} got no reply within "
                    f"{timeout:g} s, so the host is down or cut off from this machine, or a firewall drops the "
                    f"connection; check that the host is up and that port {port} is open to this machine")
        except OSError as e:
            return (f"{sockaddr[0]} cannot be reached from here ({e.strerror or e}): no route leads to it, or "
                    "nothing there answers the network; check this machine's network and routes to it")
    return None


def reachable_host(bind_host: str) -> str:
    """A host that peers can use to reach a server bound to ``bind_host``: the bind host
    itself, or for a wildcard the address of the interface the default route leaves by;
    without a default route, the first interface address that is not loopback (the
    machine's name if there is none)."""
    host = strip_brackets(bind_host)
    if not is_wildcard(host):
        return host
    probe = _ROUTE_PROBE_V6 if host == "::" else _ROUTE_PROBE
    try:
        return route_to(*probe)
    except OSError:
        return next(iter(interface_addresses()), socket.gethostname())


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces, loopback left out, in interface
    order (Linux: SIOCGIFADDR; elsewhere none)."""
    try:
        import fcntl
    except ImportError:
        return []
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


class PortReservation:
    """A port of ``host`` held for a jax.distributed coordinator until its coordination
    service runs.

    The coordinator cannot bind port 0 and say which port it got, so its port is chosen
    before it starts: for an island, every host reserves one before it knows its rank and
    the controller hands rank 0's to all; ``pathways spmd`` reserves one per group.
    Releasing the reservation before the coordination service binds would leave a window
    for another process to take the port; instead the socket is bound with SO_REUSEPORT and
    never listens, and gRPC servers (the coordination service is one) bind with
    SO_REUSEPORT on Linux, so the service binds beside it and no other process can take the
    port in between."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(family_of(host), socket.SOCK_STREAM)
        try:
            if hasattr(socket, "SO_REUSEPORT"):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._sock.bind((strip_brackets(host), 0))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()
