"""A worker's persistent compilation cache: executables kept in a directory, keyed by
everything that decides what XLA compiles, so that a worker that starts again (its island
healed, its controller came back, the next job) or another worker of the machine loads an
executable in about a millisecond instead of compiling it again (tens of milliseconds for
a small function, minutes for a large model).

``pathways worker --compile-cache DIR`` (default: ``PATHWAYS_COMPILE_CACHE``, else JAX's
own ``JAX_COMPILATION_CACHE_DIR``) turns it on. "xla" functions (the IFRT proxy's) are kept
here; jax.export functions are compiled by ``jax.jit``, so JAX's own persistent cache keeps
them, in ``DIR/jax``, with no minimum compile time.

Loading an executable runs its code: the directory must be writable by the operator alone,
as for JAX's cache. A file that cannot be read back (truncated, or from another jaxlib) is
compiled again and replaced; a cache that cannot be written costs the compile only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any, Optional

from pathways import config

JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
_FORMAT = b"pathways-xla-1"

log = logging.getLogger("pathways.worker")


def digest(*parts: bytes) -> str:
    """sha256 of ``parts``, each prefixed by its length, so that no two different sequences
    of parts share a digest by moving bytes across a boundary."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def directory_from(flag: Optional[str], environ: Any = os.environ) -> Optional[str]:
    """The cache directory a worker uses: ``--compile-cache``, else PATHWAYS_COMPILE_CACHE,
    else JAX_COMPILATION_CACHE_DIR; None: no cache."""
    return flag or config.COMPILE_CACHE.get(environ) or environ.get(JAX_ENV) or None


class CompileCache:
    """Executables of one backend in ``directory``; ``hits`` and ``misses`` count lookups."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = os.path.realpath(directory)
        self.hits = 0
        self.misses = 0

    def key(self, backend: Any, *parts: bytes) -> str:
        """The key of compiling ``parts`` (artifact, options, device ids) with ``backend``:
        jaxlib's and the backend's versions and XLA_FLAGS change what XLA makes of them."""
        import jax

        return digest(_FORMAT, jax.__version__.encode(), backend.platform.encode(),
                      backend.platform_version.encode(), os.environ.get("XLA_FLAGS", "").encode(),
                      f"{jax.process_index()}/{jax.process_count()}".encode(), *parts)

    def load(self, key: str, backend: Any, devices: Any, options: Any) -> Optional[Any]:
        """The executable stored under ``key``, loaded onto ``devices``; None if there is none
        or it cannot be loaded (it is removed then, to be compiled again)."""
        path = os.path.join(self.directory, key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self.misses += 1
            return None
        try:
            executable = backend.deserialize_executable(data, devices, options)
        except Exception as e:  # written by another jaxlib, or damaged: compile it again
            log.warning("the compile cache's %s could not be loaded (%s); compiling again", path, e)
            _remove(path)
            self.misses += 1
            return None
        self.hits += 1
        return executable

    def store(self, key: str, backend: Any, executable: Any) -> None:
        """Keep ``executable`` under ``key``; written whole or not at all, so that workers
        sharing the directory never read half a file."""
        try:
            data = backend.serialize_executable(executable)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.directory, key))
            except BaseException:
                _remove(tmp)
                raise
        except Exception as e:  # a full disk or an executable XLA cannot serialize: it stays compiled here
            log.warning("could not keep an executable in the compile cache %s: %s", self.directory, e)


def use_jax_cache(directory: str) -> None:
    """Have ``jax.jit`` keep its executables in ``directory/jax``, however fast they compiled
    (a worker compiles for clients who wait for it)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(directory, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
