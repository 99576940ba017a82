"""A process template: a process that has imported the modules a local cluster's controller
and workers run (JAX among them, a second or two of CPU) and forks each of them from its
image on request, so that a process starts in milliseconds instead of importing it all again.

A local cluster (cluster.py) starts its processes through the template of the process that
owns it (``template_for``): one template serves every cluster of that process whose
environment agrees on what is read at import time (``IMPORT_ENV_PREFIXES``). A request is a
command line, ``python -m MODULE ARGS`` or a worker's keeper (keeper.py), its environment and
working directory, and the file descriptors its stdout and stderr go to; the template forks,
and the child becomes that command: its environment, directory, title in ``ps``, outputs,
default signal handlers, and ``MODULE`` run as ``python -m`` runs it. A keeper forks its worker from its own image in turn
(``fork_command``), so that a worker restarting after a lost host costs no import either.

The template is the parent of what it forks. It reaps them and tells its owner each exit
status; the owner waits for them on a pidfd and signals them through it. It stays
single-threaded (a fork copies only the forking thread), exits when its owner does (its
socket closes, or it is orphaned), and what it forked exits after it (``PATHWAYS_PARENT_PID`` names
the template in their environment, keeper.exit_with_parent).
"""

from __future__ import annotations

import array
import atexit
import gc
import importlib
import json
import os
import queue
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import NamedTuple, NoReturn, Optional, Sequence, Union

import setproctitle

from pathways import config, keeper
from pathways.errors import ConnectError
from pathways.threads import Threads

# Variables read when Python starts or when the preloaded modules are imported (JAX's
# configuration, jaxlib's C++ logging, the BLAS and OpenMP runtimes): clusters whose
# environments differ in any of them get templates of their own.
IMPORT_ENV_PREFIXES = ("PYTHON", "JAX_", "XLA_", "TF_", "LD_", "OMP_", "OPENBLAS_", "MKL_")
START_TIMEOUT = 120.0  # seconds for a template to import its modules
REQUEST_TIMEOUT = 30.0  # seconds for a template to fork what it was asked to
_MESSAGE_BYTES = 1 << 20
_KEEPER = os.path.realpath(keeper.__file__)
# The directory this process imports the package from: the template starts there, so that
# `python -m` puts it first on its path and it imports the same package (a script's
# process may import an installed copy while its working directory holds another).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


class Template:
    """The owner's side of a template process: ``spawn`` a command, and learn its exit status
    with ``exit_code``. Thread-safe: every local cluster of the process may use it."""

    def __init__(self, preload: Sequence[str], env: dict[str, str]) -> None:
        self.preload = tuple(preload)
        self.owner = os.getpid()  # a fork of the owner shares its socket, but not its template
        self._threads = Threads("a process template's owner")  # its reader
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # One BLAS thread: the template must stay single-threaded to fork safely.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pathways.template", str(theirs.fileno()), *self.preload],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd=_PACKAGE_ROOT,
                env={**env, "OPENBLAS_NUM_THREADS": "1"})
        self._socket = ours
        self._socket.settimeout(START_TIMEOUT)
        try:
            ready = _receive(self._socket)
        except (OSError, ValueError) as e:  # socket.timeout is an OSError
            ready = Failed(f"{type(e).__name__}: {e}")
        if not isinstance(ready, Ready):
            self.close()
            raise ConnectError(f"the process template did not start: "
                               f"{ready.error if isinstance(ready, Failed) else 'it exited'}")
        self._socket.settimeout(None)
        self._lock = threading.Lock()
        self._replies: queue.Queue[Message] = queue.Queue()
        self._exited: dict[int, int] = {}
        self._changed = threading.Condition()
        self.alive = True
        self._threads.start(self._read, "pathways-template")

    def spawn(self, argv: Sequence[str], env: dict[str, str], stdout: int) -> int:
        """Fork ``argv`` (``python -m MODULE ...`` or a keeper's command, keeper.command) with
        ``env``, in this process's working directory, its stdout on file descriptor ``stdout``
        and its stderr on this process's; returns its pid."""
        request = _encode(Spawn(list(argv), env, os.getcwd()))
        with self._lock:  # one request at a time: replies come in order
            try:
                if not self.alive:
                    raise OSError("closed")
                self._socket.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                  array.array("i", [stdout, 2]))])
            except OSError:
                raise ConnectError("the process template exited; start the cluster again") from None
            try:
                reply = self._replies.get(timeout=REQUEST_TIMEOUT)
            except queue.Empty:
                self.alive = False  # a late reply would answer the next request: use another template
                raise ConnectError(f"the process template did not start {argv[3:5]} within "
                                   f"{REQUEST_TIMEOUT:g} s") from None
        if not isinstance(reply, Started):
            raise ConnectError(f"the process template could not start {argv[3:5]}: "
                               f"{reply.error if isinstance(reply, Failed) else reply}")
        return reply.pid

    def exit_code(self, pid: int, timeout: float) -> Optional[int]:
        """The exit status of ``pid`` (as ``Popen.returncode``: minus the signal that ended it)
        once the template has reaped it; None if it does not within ``timeout`` seconds or the
        template is gone."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited or not self.alive, timeout)
            return self._exited.pop(pid, None)

    def close(self) -> None:
        """Stop the template: it exits once its socket closes (what it forked exits after it)."""
        self.alive = False
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the reader: a close alone would not
        except OSError:
            pass  # not connected: the template is gone
        self._socket.close()
        self._threads.join()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self) -> None:
        while True:
            try:
                message = _receive(self._socket)
            except (OSError, ValueError):
                message = None
            if message is None:  # the template exited
                with self._changed:
                    self.alive = False
                    self._changed.notify_all()
                self._replies.put(Failed("the process template exited"))
                return
            if isinstance(message, Exited):
                with self._changed:
                    self._exited[message.pid] = message.code
                    self._changed.notify_all()
            else:
                self._replies.put(message)


_templates: dict[tuple, Template] = {}
_templates_lock = threading.Lock()


@atexit.register
def _close_templates() -> None:
    """At this process's exit, its templates exit before it does, and so what they forked
    (the processes of clusters still running): nothing outlives the program that started it."""
    with _templates_lock:
        for template in _templates.values():
            if template.owner == os.getpid():
                template.close()
        _templates.clear()


def template_pids() -> list[int]:
    """The pids of the templates this process runs."""
    with _templates_lock:
        return [t.process.pid for t in _templates.values() if t.owner == os.getpid() and t.process.poll() is None]


def template_for(preload: Sequence[str], env: dict[str, str]) -> Template:
    """This process's template for processes with environment ``env`` that run the modules
    ``preload``: a running one that fits, else a new one (seconds: it imports them)."""
    key = (tuple(preload), tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES))))
    with _templates_lock:
        template = _templates.get(key)
        if (template is None or template.owner != os.getpid() or not template.alive
                or template.process.poll() is not None):
            template = _templates[key] = Template(preload, env)
        return template


class ForkedChild:
    """A child forked by ``fork_command``, with the part of ``subprocess.Popen``'s interface
    a keeper uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: Optional[int] = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Reaped already by the poll this one interrupted (the keeper's signal handler
                # runs between bytecodes): that poll records the status once it resumes.
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        # The pidfd is closed here only, never in poll: the keeper's signal handler polls, and
        # may run between the check below and the select, which must still find it open.
        if self.returncode is None:
            select.select([self._pidfd], [], [], timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:  # it exited, and a poll being interrupted reaped it
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_command(argv: list[str], env: dict[str, str]) -> ForkedChild:
    """In a keeper forked by a template: fork its worker from this image."""
    pid = os.fork()
    if pid == 0:
        _become(argv, env, close=())
    return ForkedChild(pid, argv)


def _become(argv: list[str], env: dict[str, str], close: Sequence[int], outputs: Sequence[int] = (),
            cwd: Optional[str] = None) -> NoReturn:
    """In a forked child: close the parent's ``close`` descriptors, put ``outputs`` (passed
    descriptors) on stdout and stderr, then become ``argv`` in ``cwd`` and exit with its
    status, as the interpreter would."""
    code = 1
    try:
        setproctitle.setproctitle(" ".join(argv))  # first: it finds the title's memory through the environment
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(outputs, start=1):
            os.dup2(fd, target)
        for fd in set(outputs) - {1, 2}:
            os.close(fd)
        if cwd is not None:
            os.chdir(cwd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        if config.PARENT_PID.name in os.environ:  # what forked it is its parent now
            os.environ[config.PARENT_PID.name] = str(os.getppid())
        sys.orig_argv = list(argv)
        code = _run(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: B036 - reported as the interpreter would, then the exit status says it
        traceback.print_exc()
    try:
        # What the interpreter does at exit: join its non-daemon threads (after telling
        # executors to stop), run the exit handlers, flush.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(argv: list[str]) -> int:
    args = argv[1:]
    if args[:1] == ["-I"]:
        args = args[1:]
    if args[:1] == ["-m"] and len(args) > 1:
        sys.argv = [argv[0], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    if args and os.path.realpath(args[0]) == _KEEPER:
        sys.argv = args
        return keeper.main(args[1:], start=fork_command)
    raise SystemExit(f"a process template runs `python -m MODULE ...` or a worker's keeper, not {argv}")


# ---- the messages between an owner and its template (JSON, one a datagram) ----------------

# the owner asks: fork argv with env in cwd (its outputs' file descriptors ride along)
Spawn = NamedTuple("Spawn", [("argv", list), ("env", dict), ("cwd", str)])
Ready = NamedTuple("Ready", [("pid", int)])  # the template imported its modules and takes requests
Started = NamedTuple("Started", [("pid", int)])  # the answer to a Spawn: the child's pid
# a child the template forked exited with this code (as Popen.returncode)
Exited = NamedTuple("Exited", [("pid", int), ("code", int)])
Failed = NamedTuple("Failed", [("error", str)])  # the template could not do what was asked, or is gone

Message = Union[Spawn, Ready, Started, Exited, Failed]
_MESSAGES: dict[str, type] = {kind.__name__: kind for kind in (Spawn, Ready, Started, Exited, Failed)}


def _encode(message: Message) -> bytes:
    return json.dumps({"t": type(message).__name__, **message._asdict()}).encode()


def _decode(data: bytes) -> Message:
    """The message ``data`` holds; ValueError if it holds none."""
    fields = json.loads(data)
    tag = fields.pop("t", None) if isinstance(fields, dict) else None
    kind = _MESSAGES.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise ValueError(f"not a template message: {data[:200]!r}")
    try:
        return kind(**fields)
    except TypeError as e:
        raise ValueError(f"a malformed {kind.__name__}: {e}") from None


def _send(sock: socket.socket, message: Message) -> None:
    sock.send(_encode(message))


def _receive(sock: socket.socket) -> Optional[Message]:
    """The next message, or None once the other side has closed the socket."""
    data = sock.recv(_MESSAGE_BYTES)
    return _decode(data) if data else None


# ---- the template process ----------------------------------------------------------------


def serve(fd: int, preload: Sequence[str]) -> None:
    """The template: import ``preload``, then fork a child for each request on the socket
    ``fd`` and report each child's exit, until the owner closes the socket or exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is its owner's to handle
    owner = os.getppid()
    sock = socket.socket(fileno=fd)
    try:
        for module in preload:
            importlib.import_module(module)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            raise RuntimeError(f"importing {list(preload)} started {threads - 1} thread(s); forking would lose them")
        # What the imports made lives as long as every process forked from here: frozen, it is
        # skipped by their garbage collections (a worker's after each closed session, and the
        # interpreter's own), 0.4 ms each instead of 160 ms with JAX loaded, and its pages stay
        # shared with the template instead of being written to by each collection.
        gc.collect()
        gc.freeze()
    except Exception as e:
        _send(sock, Failed(f"{type(e).__name__}: {e}"))
        return
    _send(sock, Ready(os.getpid()))
    children: dict[int, int] = {}  # pidfd -> pid
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        while os.getppid() == owner:
            for key, _ in selector.select(timeout=0.5):
                if key.fileobj is sock:
                    data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 2)
                    if not data:
                        return
                    request = _decode(data)
                    if not isinstance(request, Spawn):
                        raise ValueError(f"a template takes Spawn requests, not {request}")
                    pid = os.fork()
                    if pid == 0:
                        _become(request.argv, request.env, close=[selector.fileno(), fd, *children],
                                outputs=fds, cwd=request.cwd)
                    for passed in fds:
                        os.close(passed)
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = pid
                    selector.register(pidfd, selectors.EVENT_READ)
                    _send(sock, Started(pid))
                else:
                    pidfd = key.fd
                    selector.unregister(pidfd)
                    os.close(pidfd)
                    pid = children.pop(pidfd)
                    _, status = os.waitpid(pid, 0)
                    _send(sock, Exited(pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
