"""The executable cache: compiles jax.export artifacts and "xla" functions (StableHLO
artifacts with xla CompileOptions, worker/xla.py) in the background.

Compilation starts when a function is registered, not when it is first run; two
registrations of the same artifact on the same layouts (or devices and options) share one
compilation, which is freed when the last session that registered it is dropped.
"""

from __future__ import annotations

import hashlib
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pathways.errors import WireError
from pathways.ir import Device, Layout
from pathways.protocol.check import MAX_NAME, clip_text
from pathways.protocol.handles import session_of
from pathways.protocol.messages import Compiled
from pathways.worker.compile_cache import CompileCache, use_jax_cache
from pathways.worker.xla import compile_xla, fingerprint as xla_fingerprint

MAX_CACHED_SHARDINGS = 4096  # layouts come from the wire: the cache must not grow without bound


def island_devices() -> dict[tuple[int, int], Any]:
    """Every device of this host's island by (host rank, local index). Without
    jax.distributed the island is this host alone, rank 0."""
    by_rank: dict[int, list] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_rank.setdefault(d.process_index, []).append(d)
    return {(rank, i): d for rank, ds in by_rank.items() for i, d in enumerate(ds)}


class Executables:
    def __init__(self, cache: Optional[CompileCache] = None) -> None:
        """``cache``: where executables are kept across processes (none: compiled in each)."""
        self._cache = cache
        if cache is not None:
            use_jax_cache(cache.directory)
        self._devices = island_devices()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pathways-compile")
        self._by_fingerprint: dict[str, Future] = {}
        self._by_key: dict[int, tuple[Future, str]] = {}
        self._fingerprint_of: dict[int, str] = {}
        self._multi_device: set[int] = set()
        # key -> (input avals, layouts) of a multi-host function; None: the executable says (xla)
        self._multi_host: dict[int, Optional[tuple[list, list[Layout]]]] = {}
        self.rank = jax.process_index()  # this host's rank in its island
        self._shardings: dict[Layout, NamedSharding] = {}
        self._lock = threading.Lock()

    def register(self, key: int, name: str, blob: bytes, ins: list[Layout], outs: list[Layout]) -> None:
        for layout in (*ins, *outs):
            self.sharding(layout)  # fail now, on the registration, for devices we lack
        try:
            exported = jax.export.deserialize(bytearray(blob))
        except Exception as e:
            raise WireError(f"function {name!r} is not a jax.export artifact: {e}") from None
        multi_host = any(rank != self.rank for layout in ins + outs for rank, _ in layout.devices)
        self._register(key, name, _fingerprint(exported, ins, outs),
                       lambda: self._pool.submit(self._compile, exported, ins, outs),
                       any(len(layout.devices) > 1 for layout in ins + outs),
                       (list(exported.in_avals), ins) if multi_host else False)

    def register_xla(self, key: int, name: str, artifact: bytes, options: bytes, devices: list[tuple[int, int]],
                     workers: list[int], report: Optional[Callable[[Compiled], None]] = None) -> None:
        """Compile StableHLO ``artifact`` with serialized CompileOptionsProto ``options`` on
        ``devices`` (logical device i is pair i; ``workers`` host them, in rank order).
        ``report`` (given on the host of the first device) receives the ``Compiled``
        message once it is done, whether it compiled or failed."""
        future = self._register(
            key, name, xla_fingerprint(artifact, options, devices, workers),
            lambda: self._pool.submit(compile_xla, name, artifact, options, devices, workers, self._devices,
                                      self.sharding, self._cache),
            len(devices) > 1, None if any(rank != self.rank for rank, _ in devices) else False)
        if report is not None:
            future.add_done_callback(lambda f: report(_compiled(key, name, f)))

    def _register(self, key: int, name: str, fingerprint: str, submit: Callable[[], Future], multi_device: bool,
                  multi_host: Any) -> Future:
        """Share or start the compilation of ``fingerprint`` for function ``key``.
        ``multi_host``: False for a function on this host alone, else its placeholders'
        (avals, layouts), or None when the executable gives them."""
        with self._lock:
            future = self._by_fingerprint.get(fingerprint)
            if future is None:
                future = submit()
                self._by_fingerprint[fingerprint] = future
            self._by_key[key] = (future, name)
            previous = self._fingerprint_of.get(key)
            self._fingerprint_of[key] = fingerprint
            if previous is not None and previous != fingerprint:
                self._forget_unused((previous,))
            self._multi_device.discard(key)
            self._multi_host.pop(key, None)
            if multi_device:
                self._multi_device.add(key)
            if multi_host is not False:
                self._multi_host[key] = multi_host
        return future

    def drop_session(self, session: int) -> int:
        """Forget the functions of ``session`` (their keys are the session's handles), and
        every compilation no other session's function shares; returns how many keys went."""
        with self._lock:
            keys = [k for k in self._by_key if session_of(k) == session]
            fingerprints = set()
            for k in keys:
                del self._by_key[k]
                fingerprints.add(self._fingerprint_of.pop(k))
                self._multi_device.discard(k)
                self._multi_host.pop(k, None)
            self._forget_unused(fingerprints)
        return len(keys)

    def _forget_unused(self, fingerprints: Any) -> None:
        """Drop the compilations of ``fingerprints`` that no key refers to (lock held)."""
        used = set(self._fingerprint_of.values())
        for fingerprint in fingerprints:
            if fingerprint not in used:
                self._by_fingerprint.pop(fingerprint).cancel()  # stops it only if not started yet

    def get(self, key: int) -> tuple[Future, str] | None:
        return self._by_key.get(key)

    def multi_device(self, key: int) -> bool:
        """Whether function ``key`` runs on several devices (so it may hold collectives)."""
        return key in self._multi_device

    def placeholders(self, key: int, executable: Any) -> list | None:
        """Zero inputs for multi-host function ``key`` compiled as ``executable`` (None for
        a function of one host). A host whose inputs were poisoned still runs such a
        function on these, so that its peers' collectives find it and do not hang; its
        outputs are discarded."""
        if key not in self._multi_host:
            return None
        spec = self._multi_host[key]
        if spec is None:  # an xla function: its executable knows its parameters
            spec = ([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in executable.in_avals],
                    executable.metadata.ins)
        out = []
        for aval, layout in zip(*spec):
            zeros = np.zeros(aval.shape, aval.dtype)
            out.append(jax.make_array_from_callback(aval.shape, self.sharding(layout), lambda index: zeros[index]))
        return out

    def device(self, pair: Device) -> Any:
        """The jax device of (host rank, device index) ``pair``; WireError if the island has none."""
        device = self._devices.get(tuple(pair))
        if device is None:
            raise WireError(f"device {tuple(pair)} (host rank, index) is not one of this worker's island's "
                            f"{sorted(self._devices)}")
        return device

    def sharding(self, layout: Layout) -> NamedSharding:
        sharding = self._shardings.get(layout)
        if sharding is None:
            missing = [d for d in layout.devices if d not in self._devices]
            if missing:
                raise WireError(f"layout names devices {missing} (host rank, index) that this worker's "
                                f"island lacks; it has {sorted(self._devices)}")
            devices = np.array([self._devices[d] for d in layout.devices]).reshape(layout.mesh_shape)
            mesh = Mesh(devices, layout.axis_names)
            sharding = NamedSharding(mesh, PartitionSpec(*layout.spec))
            if len(self._shardings) < MAX_CACHED_SHARDINGS:
                self._shardings[layout] = sharding
        return sharding

    def _compile(self, exported: jax.export.Exported, ins: list[Layout], outs: list[Layout]) -> Any:
        in_shardings = [self.sharding(x) for x in ins]
        out_shardings = [self.sharding(x) for x in outs]
        if len(exported.in_avals) != len(ins) or len(exported.out_avals) != len(outs):
            raise WireError(f"artifact takes {len(exported.in_avals)} inputs and returns "
                            f"{len(exported.out_avals)}, but {len(ins)} and {len(outs)} layouts were given")
        jitted = jax.jit(exported.call, in_shardings=in_shardings, out_shardings=out_shardings)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exported.in_avals, in_shardings)]
        return jitted.lower(*args).compile()

    def __len__(self) -> int:
        return len(self._by_fingerprint)

    def compiled(self) -> int:
        """How many distinct executables have finished compiling successfully."""
        with self._lock:
            futures = list(self._by_fingerprint.values())
        return sum(1 for f in futures if f.done() and f.exception() is None)

    def cache_counts(self) -> tuple[int, int]:
        """The compile cache's hits and misses for "xla" functions (both 0 without a cache)."""
        cache = self._cache
        return (cache.hits, cache.misses) if cache else (0, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compiled(key: int, name: str, future: Future) -> Compiled:
    """The Compiled message for function ``key`` whose compilation ``future`` finished."""
    if future.cancelled():
        return Compiled(key, f"compiling {name!r} was cancelled: the function was dropped")
    error = future.exception()
    if error is not None:
        text = f"compiling {name!r} failed: {type(error).__name__}: {error}"
        return Compiled(key, clip_text(text))
    meta = future.result().metadata
    return Compiled(key, "", meta.ins, meta.outs, meta.out_types, meta.in_shardings, meta.out_shardings,
                    meta.in_layouts, meta.out_layouts, meta.donated, meta.fingerprint, meta.name[:MAX_NAME],
                    analysis=meta.analysis, token_outs=meta.token_outs)


_LOCATION_LINE = re.compile(r"^#loc\d*\s*=.*$", re.MULTILINE)
_LOCATION_REF = re.compile(r"\s*loc\((?:#loc\d*|unknown)\)")


def _fingerprint(exported: jax.export.Exported, ins: list[Layout], outs: list[Layout]) -> str:
    """A hash of the computation and its layouts, blind to source locations, so the same
    function lowered from two call sites (or by two clients) compiles once."""
    stripped = _LOCATION_REF.sub("", _LOCATION_LINE.sub("", exported.mlir_module()))
    module = "\n".join(line for line in stripped.splitlines() if line.strip())
    return hashlib.sha256((module + repr((ins, outs))).encode()).hexdigest()
