"""Connecting, the default session, and moving host data to and from the cluster."""

from __future__ import annotations

import atexit
import gc
import os
import threading
from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec

from pathways import config
from pathways.client.array import Array, _Buffer
from pathways.client.compiled import check_divisible, host_array
from pathways.client.devices import NamedSharding, VirtualDeviceSet, VirtualMesh, slice_of
from pathways.client.session import DEFAULT_TIMEOUT, Session
from pathways.client.timeline import RecordingBlock
from pathways.cluster import Island, LocalCluster
from pathways.defaults import DEFAULT_WINDOW
from pathways.errors import ArrayDeletedError, SignatureError
from pathways.wire import security as sec
from pathways.wire.security import Security

_default: Optional[Session] = None
_lock = threading.Lock()

# What pw.connect() with no address starts: enough for the paper's Figure 2 program, whose
# three 2-device slices land on two hosts so that data moves between workers.
EMBEDDED_HOSTS = 2
EMBEDDED_DEVICES_PER_HOST = 2


def connect(address: Optional[str] = None, timeout: float = 30.0, weight: float = 1.0, token: Optional[str] = None,
            tls_ca: Optional[str] = None) -> Session:
    """Connect to a controller and make it the default session.

    ``address`` is ``grpc://host:port``; without it, ``PATHWAYS_ADDRESS`` is used, and
    without that an embedded local cluster is started (and stopped at exit). ``timeout`` is
    how many seconds to wait for the controller to answer; a refused connection raises
    ``ConnectError`` within about 2 s, and an address of another form at once. ``weight`` is
    this client's share of the devices under the controller's fair policy: clients that
    keep an island busy get device time in proportion to their weights.

    ``token`` is the cluster's shared token (default: ``PATHWAYS_TOKEN``); a cluster that
    requires another raises ``AuthenticationError`` at once. ``tls_ca`` is the PEM file of
    the CA that signed the cluster's certificates, for a cluster that uses TLS (default:
    ``PATHWAYS_TLS_CA``). An embedded cluster uses the token, and no TLS.
    """
    global _default
    address = address or config.ADDRESS.get()
    if address:
        session = Session(address, timeout, weight=weight, security=sec.for_client(token, tls_ca))
    else:
        if tls_ca is not None:
            raise ValueError("tls_ca= verifies a running cluster's certificates: pass its address too (the "
                             "embedded cluster started without an address uses no TLS)")
        security = Security(token=token if token is not None else sec.env_token())
        cluster = LocalCluster.of_hosts(EMBEDDED_HOSTS, EMBEDDED_DEVICES_PER_HOST, security)
        cluster.start()
        try:
            session = Session(cluster.address, timeout, owned_cluster=cluster, weight=weight, security=security)
        except BaseException:
            cluster.stop()
            raise
    with _lock:
        previous, _default = _default, session
    if previous is not None:
        previous.close()
    return session


def set_default_session(session: Optional[Session]) -> None:
    global _default
    with _lock:
        _default = session


def default_session() -> Session:
    """The session pw.* calls use, connecting (and maybe starting a cluster) on first use."""
    session = _default
    if session is None:
        session = connect()
    return session


def suspend(path: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Suspend the default session (``Session.suspend``): its arrays leave the devices (for
    the workers' host memory, or files under ``path``) and its slices are released."""
    default_session().suspend(path, timeout)


def resume(timeout: float = DEFAULT_TIMEOUT) -> None:
    """Resume the default session (``Session.resume``), wherever its slices fit now."""
    default_session().resume(timeout)


def disconnect() -> None:
    """Close the default session (and the embedded cluster it started, if any)."""
    global _default
    with _lock:
        session, _default = _default, None
    if session is not None:
        session.close()


@atexit.register
def _at_exit() -> None:
    """Close the default session, then finalize what is left in reference cycles while
    gRPC's daemon threads still run: in the interpreter's last collection, after they have
    stopped, a gRPC call's finalizer may wait for ever for a lock one of them held
    (Session._let_go_of_calls)."""
    disconnect()
    gc.collect()


class ConnectedCluster(LocalCluster):
    """A local cluster that, inside a ``with`` block, has a session connected to it as the
    default session."""

    session: Optional[Session] = None

    def __enter__(self) -> "ConnectedCluster":
        self.start()
        try:
            self.session = Session(self.address, security=self.security)
        except BaseException:
            self.stop()
            raise
        self.session.local = True
        set_default_session(self.session)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.session is not None:
                if _default is self.session:
                    set_default_session(None)
                self.session.close()
        finally:
            self.stop()


def local_cluster(hosts: int = 2, devices_per_host: int = 1, islands: Optional[Sequence[Island]] = None,
                  start_timeout: float = 120.0, policy: str = "fair", window: int = DEFAULT_WINDOW,
                  unsafe_local_order: bool = False, security: Optional[Security] = None,
                  heartbeat_timeout: Optional[float] = None, ifrt: bool = False,
                  restart_workers: bool = True, suspend_dir: Optional[str] = None,
                  run_timeout: Optional[float] = None, session_memory: Optional[int] = None,
                  checkpoint_dir: Optional[str] = None, colocated_python: bool = False) -> ConnectedCluster:
    """A context manager running a controller and workers on this machine.

    One island of ``hosts`` worker processes with ``devices_per_host`` CPU devices each, or
    ``islands=[pw.Island(hosts=, devices_per_host=), ...]``; the hosts of an island form one
    jax.distributed group, so a slice may span them. Inside the ``with`` block it is the
    default session; ``.address`` is the controller's address.

    ``policy`` orders runs between clients (``"fair"``: proportional share by the weight
    given to ``pw.connect``; ``"fifo"``), ``window`` bounds the runs in flight per island.
    ``unsafe_local_order`` is for demonstrating deadlock only: workers then order clients'
    runs themselves instead of following the island's gang order. ``heartbeat_timeout``
    (seconds; default 10) is how long the controller and a worker may go silent before the
    other judges it: slow, and kept, while its host still acknowledges the connection (a
    starved, busy or stopped process; ``run_timeout`` bounds its runs); lost once its host
    has acknowledged nothing for as long too (the controller fails the worker's island until
    it heals; the worker restarts and attaches again once the controller is back).

    ``security`` (``pathways.wire.security.Security``): the token, TLS certificate and CA
    that every process of the cluster, and the session, is given; none by default. The
    controller and workers also share a worker token, drawn at random unless ``security``
    names one (``.security.worker_token``): no client can attach a process as a worker.

    ``ifrt``: the controller also serves the IFRT proxy protocol on a free loopback port,
    at ``.ifrt_address`` (``grpc://127.0.0.1:PORT``), so that unmodified JAX programs run
    on the cluster with ``JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=<.ifrt_address>``.

    ``restart_workers`` (default True): a worker process that dies, however (killed, crashed,
    an error), is started again (with a back-off), and its island heals: slices and compiled
    functions there work again, from the same client objects; arrays that lived there are lost
    (``WorkerLostError``). False: a lost worker stays lost, and errors say so.

    ``suspend_dir``: the directory under which ``pw.suspend(path=...)`` may have the workers
    write a session's arrays (``path`` must lie under it); none by default, and a suspend
    then keeps them in the workers' host memory.

    ``run_timeout``: seconds an island may have runs in flight and finish none of them
    before it is reset (a host stuck in a computation or a collective): the run's results
    raise ``DeadlineExceededError`` naming the hosts that had not finished it, those hosts
    write their threads' stacks to their logs, everything else on the island raises
    ``WorkerLostError``, and the island's hosts restart and serve again. None (default):
    a stuck run waits for ever.

    ``session_memory``: the bytes of arrays one session may hold on each worker (0: no
    limit; None, the default: three quarters of the host's memory). A put or a run's output
    past it raises ``pw.ResourceExhaustedError`` where it is read, naming the quota and the
    session's usage; the session goes on once it deletes arrays, and other sessions never
    notice. A session's arrays and functions go when it closes, and the workers hand the
    memory back to the system.

    ``checkpoint_dir``: the directory under which the workers write and read checkpoints
    themselves (``pw.save``, ``pw.load``, and orbax through pathwaysutils' persistence);
    a checkpoint's location must lie under it (``gs://BUCKET/PATH`` names
    ``checkpoint_dir/BUCKET/PATH``). None by default: no checkpoints.

    ``colocated_python``: the workers run clients' colocated Python functions
    (``jax.experimental.colocated_python`` through the IFRT proxy): the clients' code, in
    the workers' processes. False by default: refused, saying so.
    """
    return ConnectedCluster(list(islands) if islands else [Island(hosts, devices_per_host)], start_timeout,
                            policy, window, unsafe_local_order, security, heartbeat_timeout,
                            ifrt_port=0 if ifrt else None, restart_workers=restart_workers, suspend_dir=suspend_dir,
                            run_timeout=run_timeout, session_memory=session_memory, checkpoint_dir=checkpoint_dir,
                            colocated_python=colocated_python)


def trace(path: str) -> RecordingBlock:
    """``with pw.trace("run.json"):`` records every run the default session submits in the
    block, on the client, the controller and each worker, with clocks aligned, and writes
    them at its end as Chrome trace-event JSON: open it at ui.perfetto.dev, or draw it
    with ``python -m pathways trace run.json --png run.png``. ``session.trace(path)``
    does the same for another session; ``PATHWAYS_TRACE=path`` for a whole process."""
    return default_session().trace(path)


def make_virtual_device_set() -> VirtualDeviceSet:
    return VirtualDeviceSet(default_session())


def device_put(x: Any, devices_or_sharding: Any) -> Any:
    """Copy host data (a pytree of arrays) to a slice, replicated, or laid out by a
    ``pw.NamedSharding``."""
    if isinstance(devices_or_sharding, NamedSharding):
        sharding = devices_or_sharding
    else:
        s = slice_of(devices_or_sharding, "device_put's target")
        sharding = NamedSharding(VirtualMesh(s, (s.count,), ("devices",)), PartitionSpec())
    session = sharding.mesh.slice.session

    def put(leaf: Any) -> Array:
        if isinstance(leaf, Array):
            leaf = leaf.to_numpy()
        try:
            value = host_array(leaf)
        except TypeError as e:
            raise SignatureError(f"device_put takes arrays of numbers; a leaf {e}") from None
        check_divisible("device_put", "the array", value.shape, sharding.spec, sharding.mesh)
        return session.put_layout(value, sharding.layout(), sharding)

    return jax.tree.map(put, x, is_leaf=lambda leaf: isinstance(leaf, Array))


def save(tree: Any, path: str, timeout: Optional[float] = None) -> None:
    """Have the workers write every pw.Array of ``tree`` into checkpoint directory ``path``,
    each into ``path/KEY`` (``KEY``: its place in the pytree, ``jax.tree_util.keystr``), each
    distinct block once, by the host that holds it; returns once all are written, raising
    the first error a host gave. No byte of the arrays passes through this process.
    ``path`` lies under the workers' checkpoint directory (``pw.local_cluster(
    checkpoint_dir=)``, ``pathways up --checkpoint-dir``; ``gs://BUCKET/PATH`` names
    ``DIR/BUCKET/PATH`` there). ``timeout``: seconds to wait for the arrays to be computed
    and written (default: the session's result timeout)."""
    writes = []
    for key, leaf in _arrays_of(tree, "save"):
        layout, b = leaf.sharding.layout(), leaf._buffer  # on the slice's hosts as they are now
        writes.append(b.session.save_blocks(b.addresses, b.handle, layout, leaf.shape, _key_path(path, key), timeout))
    for write in writes:
        write.result()


def load(path: str, like: Any) -> Any:
    """The arrays that ``pw.save`` wrote into checkpoint directory ``path``, as a pytree
    of the structure of ``like``, each array of the shape, dtype and sharding of the
    pw.Array at its place in ``like`` (which may lay it out otherwise than it was saved:
    each host reads the blocks it holds from whatever blocks were written). Each host reads
    its own blocks from the files; nothing passes through this process. No waiting: a host
    that cannot read them fails the array, raising where it is used."""
    def load_one(key: Any, leaf: Array) -> Array:
        s = leaf.sharding.mesh.slice
        session, layout = s.session, leaf.sharding.layout()
        handle = session.allocate(1)
        moves = session.moves  # before the addresses: a move in between makes the controller drop it
        session.load_blocks(s.addresses, handle, layout, leaf.dtype, leaf.shape, _key_path(path, key), moves)
        return Array(_Buffer(session, handle, s), leaf.shape, leaf.dtype, leaf.sharding)

    treedef = jax.tree_util.tree_structure(like, is_leaf=lambda x: isinstance(x, Array))
    return jax.tree_util.tree_unflatten(treedef, [load_one(k, a) for k, a in _arrays_of(like, "load")])


def _arrays_of(tree: Any, what: str) -> list[tuple[Any, Array]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Array))[0]
    for key, leaf in leaves:
        where = jax.tree_util.keystr(key) or "the root"
        if not isinstance(leaf, Array):
            raise SignatureError(f"{what} takes a pytree of pw.Array; the leaf at {where} is a {type(leaf).__name__}")
        if leaf._buffer.deleted:
            raise ArrayDeletedError(f"the array at {where} was deleted")
    return leaves


def _key_path(path: str, key: Any) -> str:
    """Where the array at pytree place ``key`` goes under ``path``: one directory named
    by its keys (``['params']['w']`` -> ``params.w``)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key]
    name = ".".join(parts) or "array"
    if "/" in name or name in (".", ".."):
        raise SignatureError(f"an array's place in the pytree, {name!r}, cannot name a directory")
    return os.path.join(path, name)


def device_get(tree: Any) -> Any:
    """Fetch every pw.Array in ``tree`` to a numpy array; other leaves pass through."""
    return jax.tree.map(lambda x: x.to_numpy() if isinstance(x, Array) else x, tree,
                        is_leaf=lambda leaf: isinstance(leaf, Array))

