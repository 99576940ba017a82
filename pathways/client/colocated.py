"""Colocated Python calls: a part of the client session (Session), working on its state.
Each host of a call runs a function JAX pickled on its own shards of the session's arrays
and stores the results, which are told to the controller as puts are (PutNotice): a run
that reads one waits for it on its worker, and a call that fails poisons them there
(worker/colocated.py runs the function)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional, Sequence

from pathways.client.worker_calls import all_answered
from pathways.protocol import messages as m
from pathways.protocol import operator


class Colocating:
    """Session's colocated Python calls."""

    def run_colocated(self, addresses: Sequence[str], program: bytes, device_ids: Sequence[int],
                      pairs: Sequence[tuple[int, int]], inputs: Sequence[int],
                      outputs: Sequence[m.ColocatedOutput], moves: int, timeout: Optional[float] = None) -> Future:
        """Have the hosts at ``addresses`` (every host holding a device of the call) run
        ``program`` (JAX's pickle of the function and its specs, naming ``device_ids``, which
        are the (host rank, device index) ``pairs``) on arrays ``inputs``, once they are
        computed (within ``timeout`` seconds; default the session's result timeout), each
        storing its part of ``outputs``. The outputs stored on the hosts are told to the
        controller as puts are (``moves`` as ``put`` takes it). A Future of the hosts'
        answers (ColocatedDone: the string results), failing with the first error one gave."""
        wait = min(self.result_timeout if timeout is None else timeout, m.MAX_WAIT_SECONDS)
        flat = m.flat_devices(pairs)
        with self._starting_put():
            calls = []
            for address in addresses:
                stubs = self._stubs(address)
                request = m.ColocatedRequest(self.id, stubs.credential, program, tuple(device_ids), flat, tuple(inputs),
                                             tuple(outputs), wait)
                calls.append((address, stubs.colocated.future(m.pack(request.encode()), timeout=wait + 30.0)))
            for out in outputs:
                if out.layout is not None:
                    self.send(m.PutNotice(out.handle, out.layout, moves))
        answers = all_answered(calls, operator.COLOCATED_REPLY, "running it")
        stored = [o.handle for o in outputs if o.layout is not None]

        def failed(f: Future) -> None:
            # a host that refused the call before running it poisoned nothing there: the
            # results' readers here get why instead of waiting
            error = f.exception()
            if error is not None:
                for handle in stored:
                    self.poisoned.setdefault(handle, (type(error), f"the colocated Python call computing it "
                                                                   f"failed: {error}"))
        answers.add_done_callback(failed)
        return answers
