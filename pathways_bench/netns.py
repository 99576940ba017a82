"""Hosts with their own network addresses on one Linux machine: network namespaces joined by
a bridge, for the benchmarks and the tests of what crosses a network.

``Network(["a", "b"])`` makes a bridge in the root namespace and, per host, a namespace with
``lo`` up (no two hosts share a loopback) and one end of a veth pair (``eth0``) holding the
host's address; the other end is a port of the bridge. Processes started with
:meth:`Network.popen` run inside a host's namespace in their own process group; leaving the
``with`` block (normally, on an error or on Ctrl-C) ends them (SIGTERM, then SIGKILL after a
grace: processes that import jax may ignore SIGTERM), also any process left in a namespace,
and then deletes the veths, the bridge and the namespaces.

``python -m pathways_bench.netns NAME...`` makes such hosts for a person to try a deployment
of several machines on one (docs/deploy.md, "Two machines"): it prints each host's address and
the command that opens a shell in it, then keeps them until Ctrl-C or SIGTERM.

Names carry the creating process's pid (``pwn`` + 5 base-36 digits + a per-process count), so
that concurrent runs never collide, interface names stay within Linux's 15 characters, and
:func:`sweep` can delete what a killed run left behind. Needs root and iproute2's ``ip``;
:func:`unavailable` says why namespaces cannot be made here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

log = logging.getLogger("pathways.netns")

PREFIX = "pwn"
SUBNET = "10.77.0.0/24"
GRACE = 3.0  # seconds a process has to exit after SIGTERM before SIGKILL
_KILL_WAIT = 10.0  # seconds a SIGKILLed process may take to disappear
_IP_TIMEOUT = 30.0  # seconds one `ip` command may take
_IFNAME_MAX = 15  # Linux's IFNAMSIZ less the terminating zero
_PID_DIGITS = 5  # base 36: up to 60 million, above Linux's largest pid (2^22)
_HOST_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An `ip` command failed, or a process in a namespace could not be ended."""


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if not n:
            return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # Its own session: a Ctrl-C at the terminal must not kill the `ip` commands of a cleanup.
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT,
                              start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {e}") from None
    if check and done.returncode:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _namespace_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)  # fails once the namespace is gone
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces, veths and bridges named with ``prefix`` whose creating process
    is gone (a run that was killed), after killing the processes left in those namespaces.
    Returns the names deleted."""
    owner = re.compile(re.escape(prefix) + f"([0-9a-z]{{{_PID_DIGITS}}})[0-9a-z]+(?:b|v[0-9]+|-.+)")

    def stale(name: str) -> bool:
        match = owner.fullmatch(name)
        return bool(match) and not _alive(int(match.group(1), 36))

    namespaces = [ns for ns in _namespaces() if stale(ns)]
    for ns in namespaces:
        for pid in _namespace_pids(ns):
            _signal(pid, signal.SIGKILL)
    _wait_gone(namespaces, _KILL_WAIT)
    links = sorted((name for name in os.listdir("/sys/class/net") if stale(name)),
                   key=lambda name: not name.endswith(tuple("0123456789")))  # veths before bridges
    # Another run may be sweeping the same leftovers, and a veth goes with its namespace: a
    # name already gone is no failure.
    deleted = [link for link in links if _ip("link", "del", link, check=False).returncode == 0]
    return [ns for ns in namespaces if _ip("netns", "del", ns, check=False).returncode == 0] + deleted


def _wait_gone(namespaces: Sequence[str], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds until no process is left in ``namespaces``; returns
    those still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for ns in namespaces for pid in _namespace_pids(ns)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@functools.lru_cache(maxsize=None)
def unavailable(prefix: str = PREFIX) -> Optional[str]:
    """Why this process cannot make network namespaces joined by a bridge here, or None if it
    can (checked once, by making one)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces exist on Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run as root, with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command is missing: install iproute2 (e.g. `apt-get install iproute2`)"
    try:
        with Network(["probe"], prefix=prefix):
            pass
    except NetnsError as e:
        return f"cannot make a network namespace joined to a bridge: {e}"
    return None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, so that it cannot cut a setup's cleanup short;
    it is raised (the previous handler is run) afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, caught[0])


class Network:
    """Hosts in network namespaces on one bridge; see the module's docstring.

    ``hosts``: the hosts' names (letters, digits, ``_``), addressed ``.1``, ``.2``, ... of
    ``subnet`` in order; or a mapping from name to address within ``subnet``. ``prefix``
    starts every name this makes (namespaces, links); ``grace`` is how long processes have
    between SIGTERM and SIGKILL when the network closes.
    """

    def __init__(self, hosts: Sequence[str] | Mapping[str, str], subnet: str = SUBNET, prefix: str = PREFIX,
                 grace: float = GRACE) -> None:
        try:
            self.subnet = ipaddress.IPv4Network(subnet)
        except ValueError as e:
            raise ValueError(f"subnet must be an IPv4 network such as {SUBNET!r}: {e}") from None
        if isinstance(hosts, str):
            raise ValueError(f"hosts must be a list of names or a mapping from name to address, not {hosts!r}")
        if isinstance(hosts, Mapping):
            self._addresses = {name: self._checked_address(name, a) for name, a in hosts.items()}
            if len(set(self._addresses.values())) != len(self._addresses):
                raise ValueError(f"hosts must have distinct addresses; got {dict(hosts)}")
        else:
            usable = list(itertools.islice(self.subnet.hosts(), len(hosts)))
            if len(set(hosts)) != len(hosts) or len(usable) < len(hosts):
                raise ValueError(f"hosts must be distinct names, at most as many as subnet {subnet} has addresses; "
                                 f"got {list(hosts)}")
            self._addresses = dict(zip(hosts, usable))
        for name in self._addresses:
            if not isinstance(name, str) or not _HOST_NAME.fullmatch(name):
                raise ValueError(f"host name {name!r} must be 1 to 32 letters, digits or '_'")
        if not self._addresses:
            raise ValueError("a network needs at least one host")
        self.tag = f"{prefix}{_base36(os.getpid()).rjust(_PID_DIGITS, '0')}{_base36(next(_counter))}"
        self.bridge = f"{self.tag}b"
        self._veths = {name: f"{self.tag}v{i}" for i, name in enumerate(self._addresses)}
        longest = max([self.bridge, *self._veths.values()], key=len)
        if len(longest) > _IFNAME_MAX:
            raise ValueError(f"prefix {prefix!r} makes interface names such as {longest!r}, longer than "
                             f"{_IFNAME_MAX} characters; use a shorter prefix")
        self.prefix = prefix
        self.grace = grace
        self._made: list[tuple[str, ...]] = []  # the `ip` commands that undo what was made, in order
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False

    def _checked_address(self, name: str, address: str) -> ipaddress.IPv4Address:
        try:
            a = ipaddress.IPv4Address(address)
        except ValueError as e:
            raise ValueError(f"host {name!r}: address {address!r} is not an IPv4 address: {e}") from None
        if a not in self.subnet or a in (self.subnet.network_address, self.subnet.broadcast_address):
            raise ValueError(f"host {name!r}: address {address} is not a host address of subnet {self.subnet}")
        return a

    # ---- the hosts -------------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return list(self._addresses)

    def addr(self, host: str) -> str:
        """The host's IPv4 address, e.g. ``"10.77.0.2"``."""
        return str(self._addresses[self._known(host)])

    def namespace(self, host: str) -> str:
        """The name of the host's namespace (for ``ip netns exec``)."""
        return f"{self.tag}-{self._known(host)}"

    def veth(self, host: str) -> str:
        """The root namespace's end of the host's veth pair, a port of the bridge."""
        return self._veths[self._known(host)]

    def _known(self, host: str) -> str:
        if host not in self._addresses:
            raise KeyError(f"no host {host!r} in this network; its hosts are {self.hosts}")
        return host

    def link_down(self, host: str) -> None:
        """Take the host's link down, as if its cable were pulled: packets to and from it are
        lost (no reset reaches anyone); its processes keep running."""
        _ip("link", "set", self.veth(host), "down")

    def link_up(self, host: str) -> None:
        """Bring the host's link back up."""
        _ip("link", "set", self.veth(host), "up")

    # ---- processes -------------------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` in the host's namespace, in a process group of its own (so that
        ending it ends its children, and a Ctrl-C at the terminal leaves it to the network's
        cleanup). ``env``: variables set on top of this process's environment. Other keyword
        arguments go to :class:`subprocess.Popen`. The network ends it when it closes."""
        if self._closed:
            raise NetnsError("this network is closed; start processes inside its `with` block")
        kw["start_new_session"] = True
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv],
                                env={**os.environ, **(env or {})}, **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float, input: Optional[str | bytes] = None,
            capture_output: bool = True, env: Optional[Mapping[str, str]] = None,
            **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in the host's namespace to its end, like :func:`subprocess.run`;
        after ``timeout`` seconds its process group is killed and TimeoutExpired raised."""
        if capture_output:
            kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        proc = self.popen(host, argv, env=env, **kw)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            self._end([proc], [])
            raise
        finally:
            _signal(proc.pid, signal.SIGKILL, group=True)  # what it started and left behind
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _end(self, procs: Sequence[subprocess.Popen], namespaces: Sequence[str]) -> list[int]:
        """End ``procs`` with their process groups, and every process left in ``namespaces``:
        SIGTERM, then SIGKILL after the grace. Returns the pids still alive."""
        left: list[int] = []
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, _KILL_WAIT)):
            for proc in procs:
                _signal(proc.pid, sig, group=True)  # also after the leader exited: its children
            for ns in namespaces:
                for pid in _namespace_pids(ns):
                    _signal(pid, sig)
            deadline = time.monotonic() + wait
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            left = [p.pid for p in procs if p.poll() is None]
            left += _wait_gone(namespaces, 0.0 if left else max(0.0, deadline - time.monotonic()))
            if not left:
                break
        return left

    # ---- making and deleting ---------------------------------------------------------------

    def __enter__(self) -> "Network":
        with _sigint_deferred():
            try:
                sweep(self.prefix)
                self._make()
            except BaseException:
                try:
                    self._close()
                except NetnsError as e:  # the error that stopped the making matters more
                    log.error("cleaning up network namespaces %s-*: %s", self.tag, e)
                raise
        return self

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for host, address in self._addresses.items():
            ns, veth = self.namespace(host), self.veth(host)
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
            self._made.append(("netns", "del", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            # Deleting the root end deletes the pair at once; a namespace's own links go only
            # when the kernel gets round to freeing the namespace.
            self._made.append(("link", "del", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        with _sigint_deferred():
            if kind is None:
                self._close()
                return
            try:
                self._close()
            except NetnsError as e:  # the error that ended the block matters more
                log.error("cleaning up network namespaces %s-*: %s", self.tag, e)

    def close(self) -> None:
        """End every process and delete what was made (also done when the ``with`` block ends)."""
        with _sigint_deferred():
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        problems = []
        left = self._end(self._procs, self._namespaces)
        if left:
            problems.append(f"processes {left} did not end after SIGKILL; their namespace lives on until they do")
        for cmd in reversed(self._made):  # each veth before its namespace, the bridge last
            try:
                _ip(*cmd)
            except NetnsError as e:
                problems.append(str(e))
        self._made.clear()
        if problems:
            raise NetnsError("; ".join(problems))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Make hosts ``NAME...`` and keep them until Ctrl-C or SIGTERM (see the module's
    docstring); the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m pathways_bench.netns",
        description="Make hosts with network addresses of their own on this Linux machine (network namespaces "
                    "on one bridge; needs root and iproute2), print each one's address and the command that "
                    "opens a shell in it, and keep them until Ctrl-C or SIGTERM, which end what runs in them "
                    "and delete them.")
    parser.add_argument("hosts", nargs="+", metavar="NAME", help="a host's name (letters, digits, _)")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped as by Ctrl-C: the hosts are deleted
    try:
        with Network(args.hosts) as net:
            for host in net.hosts:
                print(f"{host} {net.addr(host)} ip netns exec {net.namespace(host)} bash", flush=True)
            print("ready: Ctrl-C ends what runs in these hosts and deletes them", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except (NetnsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
