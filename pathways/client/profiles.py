"""Profiles of the workers' processes: a part of the client session (Session), working on
its state. A start has each host named start XLA's profiler, a stop has each write its trace
into the directory named (worker/profiling.py says where and how)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

from pathways.client.worker_calls import all_answered
from pathways.protocol import messages as m
from pathways.protocol import operator


class Profiles:
    """Session's profiles of workers."""

    def profile_hosts(self, addresses: Sequence[str], start: bool, path: str, run: str) -> Future:
        """Have the workers at ``addresses`` start their profiler for this session, or stop
        it and write their traces into directory ``path`` (read under each worker's
        checkpoint directory) as run ``run``. A Future of their answers (Profiled: the
        files each wrote), failing with the first error one gave."""
        calls = []
        for address in addresses:
            stubs = self._stubs(address)
            request = m.ProfileRequest(self.id, stubs.credential, start, path, run)
            calls.append((address, stubs.profile.future(m.pack(request.encode()), timeout=self.result_timeout)))
        return all_answered(calls, operator.PROFILED_REPLY, "starting the profiler" if start else "writing the profile")
