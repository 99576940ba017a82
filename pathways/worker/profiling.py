"""Profiles a client has a worker take: a part of the worker's core (WorkerCore), working
on its state. XLA's own profiler (``jax.profiler``) records everything this worker's
process runs between a session's start and its stop: the XLA operations of every program,
as TensorBoard and xprof show them. At the stop the trace is written into the requested
directory, read under the operator's checkpoint directory as checkpoints are
(worker/checkpoints.py): ``DIR/plugins/profile/RUN/worker-N.HOST.xplane.pb``, one file per
worker, so that the hosts of one machine do not overwrite each other's and one run holds
every host's.

One profile at a time per process (JAX's profiler is the process's): a start while
another session's profile runs is refused, saying whose. A profile a session never stops
is stopped and dropped when the session closes, and after MAX_PROFILE_SECONDS whatever
happens."""

from __future__ import annotations

import glob
import logging
import os
import secrets
import shutil
import time
from typing import Optional

import jax

from pathways.errors import RemoteError
from pathways.protocol.messages import Profiled, ProfileRequest
from pathways.worker.checkpoints import checkpoint_path

MAX_PROFILE_SECONDS = 3600.0

log = logging.getLogger("pathways.worker")


class Profile:
    """The profile running in this process: whose, where its trace goes first, since when."""

    __slots__ = ("session", "scratch", "started")

    def __init__(self, session: int, scratch: str) -> None:
        self.session, self.scratch, self.started = session, scratch, time.monotonic()


class Profiling:
    """WorkerCore's profiles."""

    def profile(self, req: ProfileRequest) -> Profiled:
        """Start the profiler for ``req.session`` or stop it and write its trace. Raises the
        error to answer."""
        self.sessions.admit_session(req.session, req.credential, "profile request")
        directory = checkpoint_path(self.checkpoint_dir, req.path, self.worker_id)
        with self._profile_lock:
            self._expire_profile()
            if req.start:
                return self._start_profile(req.session, directory)
            return self._stop_profile(req.session, directory, req.run)

    def _start_profile(self, session: int, directory: str) -> Profiled:
        running = self._profile
        if running is not None:
            raise RemoteError(f"worker {self.worker_id} is taking a profile already, for session {running.session} "
                              f"(one at a time per process); stop it first")
        scratch = os.path.join(directory, f".worker-{self.worker_id}-{secrets.token_hex(4)}.partial")
        os.makedirs(scratch)
        try:
            jax.profiler.start_trace(scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        self._profile = Profile(session, scratch)
        return Profiled(())

    def _stop_profile(self, session: int, directory: str, run: str) -> Profiled:
        running = self._profile
        if running is None or running.session != session:
            raise RemoteError(f"worker {self.worker_id} takes no profile for session {session}: start one first")
        self._profile = None
        try:
            jax.profiler.stop_trace()
            into = os.path.join(directory, "plugins", "profile", _run_name(run))
            os.makedirs(into, exist_ok=True)
            files = []
            for path in sorted(glob.glob(os.path.join(running.scratch, "plugins", "profile", "*", "*"))):
                name = f"worker-{self.worker_id}.{os.path.basename(path)}"
                os.replace(path, os.path.join(into, name))
                files.append(os.path.relpath(os.path.join(into, name), directory))
        finally:
            shutil.rmtree(running.scratch, ignore_errors=True)
        return Profiled(tuple(files))

    def _expire_profile(self, session: Optional[int] = None) -> None:
        """Stop and drop the running profile if it is ``session``'s, or older than
        MAX_PROFILE_SECONDS. Called with ``_profile_lock`` held."""
        running = self._profile
        if running is None:
            return
        if running.session != session and time.monotonic() - running.started < MAX_PROFILE_SECONDS:
            return
        self._profile = None
        try:
            jax.profiler.stop_trace()
        except Exception:  # noqa: BLE001 - a trace dropped unwritten; the next may start
            log.exception("stopping the profile of session %d failed", running.session)
        finally:
            shutil.rmtree(running.scratch, ignore_errors=True)

    def _forget_profile(self, session: int) -> None:
        with self._profile_lock:
            self._expire_profile(session)


def _run_name(run: str) -> str:
    """The run's directory name: the client's, made safe as one path component."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in run).strip("._")
    return name or time.strftime("%Y_%m_%d_%H_%M_%S")
