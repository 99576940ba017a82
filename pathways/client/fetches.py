"""Reading arrays from workers: a part of the client session (Session), working on its
state. A fetch asks the workers holding an array, in bounded waits, and follows the array
where its slice moves; a worker that stops answering waits for the controller's verdict."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Optional

import grpc
import numpy as np

from pathways import errors
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.ir import Device
from pathways.protocol import messages as m
from pathways.protocol.data import ERROR, PENDING, FetchReply
from pathways.protocol.errors import error_of
from pathways.protocol.handles import discard
from pathways.timeline import now
from pathways.wire import codec, rpc

log = logging.getLogger("pathways.client")

_POLL_SECONDS = 1.0  # a long wait for an array is split so news of a lost worker cuts it short
# pauses between fetches that a busy worker answered at once, instead of waiting
_BUSY_PAUSE, _BUSY_PAUSE_MAX = 0.005, 0.2
_VERDICT_SECONDS = 3.0  # how long a failed fetch waits for the controller to say why
# ... when the worker became unreachable: keepalive may give up on a frozen worker before
# the controller judges it (after its heartbeat timeout), and the controller's verdict names
# the host; without one the worker is slow, not lost, and the fetch is asked again
_UNREACHABLE_VERDICT_SECONDS = HEARTBEAT_TIMEOUT
# What a call to a worker ends with when the worker died, or stopped its server to restart
# (its island lost a host): this client cancels its own calls only once it knows why.
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


# Where a fetch's reply goes as it arrives (Session.fetch): the header of one worker's
# pieces and the iterator of their chunks, which the sink reads to the end.
Sink = Callable[[dict, Iterator[bytes]], None]


class Fetches:
    """Session's fetches."""

    def fetch(self, addresses: tuple[str, ...] | Callable[[], tuple[str, ...]], handle: int, wait: float,
              data: bool, device: Optional[Device] = None,
              sink: Optional[Sink] = None) -> Optional[np.ndarray | bool]:
        """Ask the workers holding ``handle`` for it: None while pending after ``wait``
        seconds, True when ready (``data`` false) or the assembled array; raises the
        error that poisoned it (RemoteError, WorkerLostError). ``addresses``: those workers'
        addresses, or a callable giving where they are now, asked again before each request:
        a slice moves when its island heals (SliceMoved), and a run sent just after the heal
        may have been read with the addresses from before. With ``device`` (host rank,
        device index; the addresses then that of its host): that device's own shard only.
        With ``sink`` (and ``data``): each worker's reply goes to it as it arrives (its
        pieces' header and their chunks, which it reads to the end), and True is returned."""
        self._refuse_if_suspended("read an array")
        self._outbox.send_held()  # the run computing the array may be among them
        where = addresses if callable(addresses) else lambda: addresses
        if self.traced:
            began = now()
            try:
                return self._fetch(where, handle, wait, data, device, sink)
            finally:
                self.recorder.span("fetch", began, 0, f"array {handle:#x}" + ("" if data else ", ready?"))
        return self._fetch(where, handle, wait, data, device, sink)

    def _fetch(self, addresses: Callable[[], tuple[str, ...]], handle: int, wait: float, data: bool,
               device: Optional[Device] = None, sink: Optional[Sink] = None) -> Optional[np.ndarray | bool]:
        deadline = time.monotonic() + wait
        assembly = None
        for i in range(len(addresses())):
            pause = _BUSY_PAUSE
            while True:
                self._raise_if_poisoned(handle)
                asked = time.monotonic()
                left = max(deadline - asked, 0.0)
                reply = self._fetch_one(lambda: addresses()[i], handle, min(left, _POLL_SECONDS), data, device,
                                        sink)
                if reply is not None:
                    break
                answered = time.monotonic()
                if answered >= deadline:
                    return None
                if answered - asked < min(left, _POLL_SECONDS) / 2:
                    # answered at once: the worker's fetch waits are taken (worker/sessions.py)
                    time.sleep(min(pause, deadline - answered))
                    pause = min(2 * pause, _BUSY_PAUSE_MAX)
            if sink is not None:
                continue
            if data and device is not None:
                (_, shard), = reply[2]  # the device's one shard, whole
                return shard
            if data:
                dtype, shape, pieces = reply
                if assembly is None:
                    assembly = codec.Assembly(dtype, shape)
                assembly.add(pieces)
        return assembly.result() if data and sink is None else True

    def _raise_if_poisoned(self, handle: int) -> None:
        if handle in self.poisoned:
            error, message = self.poisoned[handle]
            raise error(message)

    def _fetch_one(self, where: Callable[[], str], handle: int, wait: float, data: bool,
                   device: Optional[Device] = None, sink: Optional[Sink] = None) -> Any:
        """One request for ``handle`` to the worker at ``where()``: None while pending (or
        while its worker is unreachable without a verdict, or has moved: ask again), else
        the reply's value; raises the error that poisoned it."""
        self._check_alive()
        address = where()
        stubs = self._stubs(address)
        request = m.pack(m.FetchRequest(handle, wait, data, stubs.credential, device).encode())
        call = None
        fed = False  # whether ``sink`` was given part of a reply: it cannot be given one again
        try:
            call = stubs.fetch(request, timeout=wait + 30.0)
            with self._fetches_lock:
                self._fetches.setdefault(handle, set()).add(call)
            if handle in self.poisoned or self._dead is not None:
                call.cancel()  # the news came while the call was starting
            replies = iter(call)
            reply = FetchReply.read(codec.unpack(next(replies)))
            if reply.state == PENDING:
                return None
            if reply.state == ERROR:
                raise error_of(reply.kind, reply.message, errors.RemoteError)
            if not data:
                return True
            replies = self._counted(replies)
            if sink is not None:
                fed = True
                sink(reply.pieces or {}, replies)
                codec.expect_end(replies)
                return True
            result = codec.read_pieces(reply.pieces or {}, replies)
            codec.expect_end(replies)
            return result
        except grpc.RpcError as e:
            refused = rpc.refusal(e, address)
            if refused is not None:
                raise refused from None
            # A worker that died mid-call breaks the call in several ways; the controller's
            # verdict on the handle, which follows within moments, is the better error. One
            # that did not even say "pending" by the call's deadline is stopped or starved.
            unreachable = e.code() in GONE or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + (_UNREACHABLE_VERDICT_SECONDS if unreachable else _VERDICT_SECONDS)
            while (handle not in self.poisoned and time.monotonic() < deadline and self._dead is None
                   and where() == address):
                time.sleep(0.02)
            self._raise_if_poisoned(handle)
            self._check_alive()
            if unreachable and not fed:
                # no verdict: the worker moved (its island healed; the array is at its new
                # address), or the controller still has it, slow (stopped, or starved past
                # keepalive), not lost; the array is still to come, so the caller asks again
                log.info("the worker at %s holding array %#x does not answer (%s), but the controller has not "
                         "declared it lost: asking again%s", address, handle, e.code().name,
                         "" if where() == address else f", at its new address {where()}")
                return None
            if unreachable:
                raise errors.ConnectError(
                    f"the worker at {address} stopped answering ({e.code().name}) while it sent array "
                    f"{handle:#x}, but the controller has not declared it lost (it is slow: starved of CPU, busy, "
                    "or stopped); read the array again, and see `python -m pathways status`") from None
            raise errors.ConnectError(
                f"fetching from worker {address} failed ({e.code().name}); check "
                "`python -m pathways status`") from None
        except BaseException:
            if call is not None:
                call.cancel()  # whatever is left of the reply is not wanted
            raise
        finally:
            if call is not None:
                with self._fetches_lock:
                    discard(self._fetches, handle, call)

    def _counted(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks`` of a reply's array bytes, added to the session's received bytes as they pass."""
        for chunk in chunks:
            self.array_bytes.add_received(len(chunk))
            yield chunk

    def _cancel_fetches(self, handles: Optional[tuple[int, ...]]) -> None:
        """Cancel the fetches in flight for ``handles`` (all of them with None): whoever
        waits in them then raises the error the controller gave, at once."""
        with self._fetches_lock:
            if handles is None:
                doomed = [c for calls in self._fetches.values() for c in calls]
            else:
                doomed = [c for h in handles for c in self._fetches.get(h, ())]
        for call in doomed:
            call.cancel()
