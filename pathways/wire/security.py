"""Who may talk to a cluster: a shared token on every connection, and TLS.

Every process of a cluster (controller, workers, clients) is given the same token, by
``--token-file PATH`` or the environment variable PATHWAYS_TOKEN (a client also by
``pw.connect(address, token=...)``); nobody hands it on. gRPC calls carry it as metadata
(``pathways-token``), checked by a server interceptor (rpc.py). Framed TCP connections (a
worker's stream to the controller, the data plane between workers) open with a hello frame
carrying it, answered before any other frame is read (``greet``, ``refusal_of``; the frames
are handshake.py's records ``Hello`` and ``HelloAnswer``). A missing or wrong token and a
malformed hello get the same refusal, so that nothing is learned from it. A server asked to
listen beyond loopback without a token refuses to start (``check_bind``).

Workers are admitted, not trusted for holding the clients' token: the controller and its
workers also share a worker token (``--worker-token-file PATH`` or PATHWAYS_WORKER_TOKEN,
another than the clients'), which a worker's stream to the controller must greet with
(``Security.for_attach``); a controller that takes workers beyond loopback requires one
(``check_worker_admission``), and a local cluster draws one. Beyond that, a worker's data
listener admits only peers with a ticket from the controller (worker/peers.py), and a
session presents each worker a credential of its own (messages.worker_credential).

TLS: a server given ``--tls-cert`` and ``--tls-key`` serves gRPC and the workers' stream to
the controller over TLS; clients and workers verify it with ``--tls-ca``. With
``--data-plane-tls`` the array bytes between workers go over TLS too (it costs bandwidth:
``python -m pathways bench transfer`` measures how much).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hmac
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pathways import config
from pathways.errors import AuthenticationError, ConnectError, WireError
from pathways.wire import codec
from pathways.wire.addresses import strip_brackets
from pathways.wire.frames import LENGTH, recv_exactly
from pathways.wire.handshake import MAX_TOKEN_CHARS, Hello, HelloAnswer

TOKEN_METADATA = "pathways-token"  # the gRPC metadata key that carries the token
_ANSWER_BYTES = 64 * 1024  # a greeting's answer: a short refusal at most
# How long a connection to a server that requires a token may take to greet it, and how long
# a greeting waits for its answer.
HELLO_SECONDS = 10.0
_MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))' > token"
MISMATCH_ADVICE = ("if one side uses TLS and the other does not, give both the same settings "
                   "(--tls-cert/--tls-key on servers, --tls-ca or PATHWAYS_TLS_CA on every process that connects)")


class SecurityConfigError(ValueError):
    """Token or TLS settings that cannot work; the message names the flag to fix."""


@dataclass(frozen=True)
class Security:
    """One process's token and TLS settings. ``tls_cert``/``tls_key``: the PEM certificate
    and key its servers present; ``tls_ca``: the PEM CA certificate it verifies servers
    with; ``data_plane_tls``: worker-to-worker data over TLS too."""

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    data_plane_tls: bool = False
    worker_token: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token, "the token")
        if self.worker_token is not None:
            _check_token(self.worker_token, "the worker token")
            if self.worker_token == self.token:
                raise SecurityConfigError("the worker token must differ from the client token: whoever holds "
                                          "the worker token can attach a process as a worker")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityConfigError("--tls-cert and --tls-key go together: a server presents a certificate "
                                      "and proves it with its private key; give both or neither")
        if self.data_plane_tls and not (self.tls_cert and self.tls_ca):
            raise SecurityConfigError("--data-plane-tls needs --tls-cert and --tls-key (for this worker's data "
                                      "listener) and --tls-ca (to verify its peers' listeners)")

    @property
    def serves_tls(self) -> bool:
        """Whether this process's servers use TLS."""
        return self.tls_cert is not None

    @property
    def uses_tls(self) -> bool:
        """Whether this process connects to servers over TLS."""
        return self.tls_ca is not None

    def allows(self, offered: object) -> bool:
        """Whether ``offered`` (what a peer sent as its token) admits it: always when no
        token is required; compared in constant time."""
        if self.token is None:
            return True
        return isinstance(offered, str) and hmac.compare_digest(offered.encode("utf-8", "replace"),
                                                                self.token.encode())

    def for_attach(self) -> "Security":
        """The settings of a worker's stream to the controller, on both ends: the worker
        token where there is one (else the cluster's token) stands for the token."""
        return dataclasses.replace(self, token=self.worker_token or self.token, worker_token=None)

    def checked(self) -> "Security":
        """Self, once its certificate files load; SecurityConfigError naming the file if not."""
        if self.serves_tls:
            server_context(self)
        if self.uses_tls:
            client_context(self)
        return self


def _check_token(token: object, what: str) -> None:
    if not (isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_CHARS and token.isascii()
            and token.isprintable() and not any(c.isspace() for c in token)):
        raise SecurityConfigError(f"{what} must be 1 to {MAX_TOKEN_CHARS} printable ASCII characters without "
                                  f"spaces; make one with `{_MAKE_TOKEN}`")


def read_token_file(path: str, flag: str = "--token-file") -> str:
    """The token in the file at ``path`` (surrounding whitespace dropped), given by ``flag``."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SecurityConfigError(f"{flag} {path}: cannot read the token ({e}); make one with "
                                  f"`{_MAKE_TOKEN}`") from None
    _check_token(token, f"the token in {flag} {path}")
    return token


def env_token(variable: config.Variable = config.TOKEN) -> str | None:
    """The token in environment variable ``variable``, or None where it is unset or empty."""
    token = variable.text()
    if token is None:
        return None
    _check_token(token, variable.name)
    return token


def for_client(token: str | None = None, tls_ca: str | None = None) -> Security:
    """A client's settings: ``token`` and ``tls_ca`` where given, else PATHWAYS_TOKEN and
    PATHWAYS_TLS_CA."""
    if token is not None:
        _check_token(token, "token=")
    return Security(token=token if token is not None else env_token(),
                    tls_ca=tls_ca or config.TLS_CA.get()).checked()


def add_flags(parser: argparse.ArgumentParser, server: bool, data_plane: bool = True) -> None:
    """The token and TLS flags: every process takes ``--token-file`` and ``--tls-ca``;
    those that serve (``server``) also their certificate, and those with a data plane
    (workers, and a local cluster's) ``--data-plane-tls``."""
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the cluster's shared token (default: ${config.TOKEN.name}); required to "
                             "listen beyond loopback" if server else
                        f"file holding the cluster's shared token, which this process presents to it (default: "
                        f"${config.TOKEN.name}; none)")
    if server:
        parser.add_argument("--tls-cert", metavar="PATH", help="PEM certificate this process's servers present "
                                                               "(TLS; with --tls-key)")
        parser.add_argument("--tls-key", metavar="PATH", help="PEM private key of --tls-cert")
    if server:
        parser.add_argument("--worker-token-file", metavar="PATH",
                            help=f"file holding the token workers attach to the controller with (default: "
                                 f"${config.WORKER_TOKEN.name}); it must differ from the clients' token, and is "
                                 "required where the controller listens beyond loopback, so that no client can "
                                 "attach a process as a worker")
    parser.add_argument("--tls-ca", metavar="PATH",
                        help="PEM CA certificate that servers' certificates are verified with (default: "
                             f"${config.TLS_CA.name})")
    if server and data_plane:
        parser.add_argument("--data-plane-tls", action="store_true",
                            help="worker-to-worker array bytes over TLS too (costs bandwidth: `bench transfer`)")


def from_args(args: argparse.Namespace) -> Security:
    """The settings given by the flags of ``add_flags`` (and the environment)."""
    token = read_token_file(args.token_file) if args.token_file else env_token()
    worker_file = getattr(args, "worker_token_file", None)
    worker_token = (read_token_file(worker_file, "--worker-token-file") if worker_file
                    else env_token(config.WORKER_TOKEN))
    return Security(token, getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                    args.tls_ca or config.TLS_CA.get(),
                    getattr(args, "data_plane_tls", False), worker_token).checked()


def child_flags(security: Security, data_plane: bool = True) -> list[str]:
    """Command-line flags giving a child process ``security``'s TLS settings (``data_plane``:
    a worker's, with ``--data-plane-tls``; the controller has no data plane). The token
    goes by the environment (``child_env``): any user of the host can read a command line."""
    flags = ["--tls-cert", security.tls_cert, "--tls-key", security.tls_key] if security.serves_tls else []
    flags += ["--tls-ca", security.tls_ca] if security.uses_tls else []
    return flags + (["--data-plane-tls"] if data_plane and security.data_plane_tls else [])


def child_env(security: Security, env: dict[str, str], cluster_process: bool = False) -> dict[str, str]:
    """``env`` with PATHWAYS_TOKEN set to ``security``'s token (unset where it has none) and
    PATHWAYS_TLS_CA unset (the CA goes by ``child_flags``): a child of a local cluster takes
    exactly its cluster's settings, not whatever this process's environment holds. Only a
    ``cluster_process`` (a controller or worker, not a client's script) gets
    PATHWAYS_WORKER_TOKEN."""
    env = {k: v for k, v in env.items() if k not in (config.TOKEN.name, config.TLS_CA.name, config.WORKER_TOKEN.name)}
    if security.token is not None:
        env[config.TOKEN.name] = security.token
    if cluster_process and security.worker_token is not None:
        env[config.WORKER_TOKEN.name] = security.worker_token
    return env


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(strip_brackets(host)).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, security: Optional[Security], what: str) -> None:
    """Refuse to listen on ``host`` beyond loopback without a token."""
    if is_loopback(host) or (security is not None and security.token is not None):
        return
    raise SecurityConfigError(
        f"{what} would listen on {host}, beyond loopback, without a token: anyone who reaches it could run "
        f"code on this cluster and read its data. Give every process the same shared token with --token-file "
        f"PATH or {config.TOKEN.name} (make one with `{_MAKE_TOKEN}`), or listen on 127.0.0.1")


def check_worker_admission(host: str, security: Security) -> None:
    """Refuse to take workers' streams on ``host`` beyond loopback without a worker token
    of their own: with the clients' token alone, any client could attach a process as a
    worker, and be given other clients' functions and arrays."""
    if is_loopback(host) or security.worker_token is not None:
        return
    raise SecurityConfigError(
        f"the controller would take workers' connections on {host}, beyond loopback, without a worker token: any "
        f"client could then attach a process as a worker and be given other clients' programs and arrays. Give "
        f"the controller and every worker the same worker token, another than the clients' one, with "
        f"--worker-token-file PATH or {config.WORKER_TOKEN.name} (make one with `{_MAKE_TOKEN}`)")


class Refusals:
    """How many connections a server refused or turned away, and which of them to log: the
    first and then one per ``LOG_EVERY``, so that strangers, who may open connections in a
    loop, cannot fill the log. Thread-safe."""

    LOG_EVERY = 1000

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> int:
        """Count one more: the count so far when this one is to be logged, else 0."""
        with self._lock:
            self.count += 1
            return self.count if self.count % self.LOG_EVERY == 1 else 0


def refusal(server: str) -> str:
    """What a server that requires the token answers a peer without it (or with another)."""
    return (f"this {server} requires the cluster's shared token, the one given to the controller with "
            f"--token-file PATH or {config.TOKEN.name}; give this process the same one: --token-file PATH or "
            f"{config.TOKEN.name}, or pw.connect(address, token=...)")


def attach_refusal() -> str:
    """What the controller answers a worker's stream without its worker token."""
    return (f"this controller admits workers only with its worker token, the one given to it with "
            f"--worker-token-file PATH or {config.WORKER_TOKEN.name} (or, where it has none, the cluster's token); "
            "give this worker the same one")


# ---- TLS ----------------------------------------------------------------------------------

def read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{flag} {path}: cannot read it ({e})") from None


@functools.lru_cache(maxsize=8)
def _server_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
        read_pem(path, flag)  # a missing file named as such, before the SSL library's less clear error
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise SecurityConfigError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its "
                                  f"private key ({e})") from None
    return context


@functools.lru_cache(maxsize=8)
def _client_context(ca: str) -> ssl.SSLContext:
    read_pem(ca, "--tls-ca")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as e:
        raise SecurityConfigError(f"--tls-ca {ca} (tls_ca=, {config.TLS_CA.name}) is not a PEM CA certificate "
                                  f"({e})") from None
    return context


def server_context(security: Security) -> ssl.SSLContext:
    """The TLS context of ``security``'s servers (it needs tls_cert and tls_key)."""
    return _server_context(security.tls_cert, security.tls_key)


def client_context(security: Security) -> ssl.SSLContext:
    """The TLS context that verifies servers against ``security``'s CA (it needs tls_ca)."""
    return _client_context(security.tls_ca)


def wrap_client(sock: socket.socket, security: Security, host: str, address: str) -> socket.socket:
    """``sock`` over TLS, the server at ``address`` (``host``) verified; ConnectError if the
    handshake fails (within the socket's timeout)."""
    try:
        return client_context(security).wrap_socket(sock, server_hostname=host)
    except (ssl.SSLError, ssl.CertificateError, OSError) as e:
        sock.close()
        raise ConnectError(f"the TLS handshake with {address} failed ({e}): its certificate must be signed by the "
                           f"CA in --tls-ca {security.tls_ca} and issued for {host}; {MISMATCH_ADVICE}") from None


# ---- the greeting of framed TCP connections -------------------------------------------------

def hello(security: Security, ticket: tuple[int, bytes] | None = None) -> bytes:
    """The frame that opens a connection: a ``Hello`` with the token ("" for none) and, on
    the data plane, ``ticket``: the sending worker's id and its ticket for the receiver
    (see messages.data_ticket)."""
    sender, shown = ticket if ticket is not None else (None, None)
    return Hello(security.token or "", sender, shown).frame()


def admitted(security: Security, header: object) -> tuple[Optional[Hello], str]:
    """``header`` (a connection's first frame, decoded) as the ``Hello`` that admits it,
    or None and why not (for a log, never for the peer: every refusal reads the same)."""
    try:
        greeting = Hello.read(header)
    except WireError as e:
        return None, f"its first frame is not a hello ({e})"
    if not security.allows(greeting.token):
        return None, "it did not give the cluster's token"
    return greeting, ""


def refusal_of(security: Security, header: object, server: str, refused: str | None = None) -> str | None:
    """None if ``header`` (a connection's first frame, decoded) is a hello that admits it,
    else the refusal to send back (``refused``, by default ``refusal(server)``: the same
    whatever was wrong)."""
    if admitted(security, header)[0] is not None:
        return None
    return refused or refusal(server)


def answer(refused: str | None) -> bytes:
    """The frame answering a hello: admitted, or refused with ``refused``."""
    return HelloAnswer(refused).frame()


def greet(sock: socket.socket, security: Security, address: str, timeout: float,
          ticket: tuple[int, bytes] | None = None) -> None:
    """Send the hello (with ``ticket``, if given) on a new connection to ``address`` and
    wait (up to ``timeout`` seconds) for its answer: AuthenticationError if refused,
    ConnectError if the server closes the connection or answers something else."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    other = ""  # what was wrong with an answer that is not a HelloAnswer
    try:
        sock.sendall(hello(security, ticket))
        head = bytearray(LENGTH.size)
        if recv_exactly(sock, memoryview(head), deadline):
            (n,) = LENGTH.unpack(head)
            body = bytearray(min(n, _ANSWER_BYTES))
            if n <= _ANSWER_BYTES and recv_exactly(sock, memoryview(body), deadline):
                reply = codec.unpack(bytes(body))
                try:
                    refused = HelloAnswer.read(reply).refused
                except WireError as e:
                    other = f" ({e})"
                else:
                    if refused is None:
                        return
                    raise AuthenticationError(f"{address} refused this process: {refused}")
    except (OSError, WireError) as e:
        raise ConnectError(f"{address} did not answer this process's greeting ({type(e).__name__}: {e}); "
                           f"{MISMATCH_ADVICE}") from None
    raise ConnectError(f"{address} closed the connection or answered its greeting with something else{other}: is "
                       f"it a pathways server of this version? {MISMATCH_ADVICE}")
