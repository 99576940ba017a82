"""Message streams: typed messages queued, batched into payloads and drained by a stream.

What one peer sends another is a stream of payloads, each a batch of encoded messages
(``encode_batch``'s form): whatever queued while the stream was busy goes out together,
within the bounds of one payload (``payloads``). ``Outbox`` feeds a synchronous gRPC stream
from any thread, or a ``LocalStream`` (a stream between a client's threads and a server's
loop in one process, with no gRPC in between); ``LoopOutbox`` feeds a stream served on an
asyncio loop (gRPC, or framed TCP: wire/frames.py) and bounds what waits unsent, so that a
peer that does not read its replies stops being served instead of growing the server's
memory. The transports themselves are wire/rpc.py's and wire/frames.py's.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import time
import weakref
from typing import Awaitable, Callable, Iterator, Optional

import grpc

from pathways.errors import ConnectError
from pathways.protocol.messages import MAX_BATCH_MESSAGES, MAX_MESSAGE_BYTES, Message, encode_item, join_items
from pathways.wire.codec import list_header


def payloads(items: list[bytes]) -> Iterator[bytes]:
    """Messages encoded each by ``encode_item``, joined into payloads of at most
    MAX_MESSAGE_BYTES and MAX_BATCH_MESSAGES messages (one, unless halving is needed to stay
    within them): what queued up while a peer was slow to read may be more than one payload
    may carry. A single message larger than that goes alone, for its receiver to refuse.
    Each payload is what ``encode_batch`` makes of its messages."""
    if not items:
        return
    if len(items) > MAX_BATCH_MESSAGES:
        yield from payloads(items[:MAX_BATCH_MESSAGES])
        yield from payloads(items[MAX_BATCH_MESSAGES:])
        return
    if len(items) == 1 or len(list_header(len(items))) + sum(map(len, items)) <= MAX_MESSAGE_BYTES:
        yield join_items(items)
        return
    half = len(items) // 2
    yield from payloads(items[:half])
    yield from payloads(items[half:])


class Outbox:
    """A thread-safe queue of messages drained as batches by a gRPC stream generator
    (``batches``), or by a LocalStream's reads on the server's loop (``take``).

    Whatever has queued up while the stream was busy goes out as one payload (or several:
    ``payloads``). ``release(handle)`` notes a handle the peer may forget: the handles
    released before a batch starts go out at its end as one message, ``releases(handles)``
    (after every message put before them, which may still name them). Releases ride along
    with the next batch; those of a stream with nothing else to send are flushed within
    RELEASE_SECONDS by one thread of the process: a release costs no message of its own,
    and an idle stream no wake-ups. ``hold`` keeps what is put until it ends, to go out as
    one batch.
    """

    _CLOSE, _FLUSH = object(), object()

    def __init__(self, releases: Optional[Callable[[list[int]], Message]] = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._releases = releases
        self._released: collections.deque[int] = collections.deque()
        self._flushing = False  # a flush is queued and its batch not yet begun
        self._flush_lock = threading.Lock()
        self._closed = False
        # ``hold``: while held, what is put and released waits here, in order, for ``send_held``
        # (reentrant: a release may come from a __del__ run by a thread that holds the lock)
        self._holds = 0
        self._held: list[Message] = []
        self._held_releases: list[int] = []
        self._hold_lock = threading.RLock()
        # ``take``'s reader: how to wake it, whether it waits, whether it has taken the close
        self._wake: Optional[Callable[[], None]] = None
        self._waiting = False
        self._taken_all = False
        if releases is not None:
            _RELEASE_FLUSHER.watch(self)

    def put(self, message: Message) -> None:
        if self._holds:
            with self._hold_lock:
                if self._holds:
                    self._held.append(message)
                    return
        self._queued(message)

    def release(self, handle: int) -> None:
        """Note ``handle`` for ``releases`` (none once closed); safe from ``__del__`` in any thread."""
        assert self._releases is not None, "this outbox was made without releases"
        if self._closed:
            return
        if self._holds:
            with self._hold_lock:
                if self._holds:  # after the messages held before it, which may name the handle
                    self._held_releases.append(handle)
                    return
        self._released.append(handle)

    def hold(self) -> None:
        """Keep what is put and released from now on (from any thread) until ``unhold``, to
        go out then as one batch; holds nest."""
        with self._hold_lock:
            self._holds += 1

    def unhold(self) -> None:
        """End a ``hold``; the last one's end sends what was held."""
        with self._hold_lock:
            self._holds -= 1
            if not self._holds:
                self.send_held()

    def send_held(self) -> None:
        """Queue what is held now, a hold going on (for whoever is about to wait on an answer
        to it), and the releases held after it."""
        with self._hold_lock:
            held, self._held = self._held, []
            released, self._held_releases = self._held_releases, []
            if held:
                self._queued(held)
            # after the messages: a batch takes the releases noted before it starts, so these
            # go out in the messages' batch or a later one, never ahead of them
            self._released.extend(released)

    def flush(self) -> None:
        """Have the stream send the releases noted so far, if any (one flush queued at a
        time: a stream no one reads does not pile them up)."""
        with self._flush_lock:
            if self._released and not self._flushing and not self._closed:
                self._flushing = True
                self._queued(self._FLUSH)

    def close(self) -> None:
        """End the stream after whatever was put before."""
        self._closed = True
        self._queued(self._CLOSE)

    def _queued(self, item: object) -> None:
        self._queue.put(item)
        if self._waiting:  # a reader on a loop waits for it (``take``)
            self._waiting = False
            assert self._wake is not None
            self._wake()

    def batches(self) -> Iterator[bytes]:
        """Yield packed batches until closed (everything put before the close goes out)."""
        closing = False
        while not closing:
            batch, closing = self._drain(self._queue.get())
            if batch:
                yield from payloads(batch)

    def take(self, wake: Callable[[], None]) -> Optional[list[bytes]]:
        """For a reader on an event loop (LocalStream), instead of ``batches``: the payloads
        of what is queued now, or [] when nothing is (``wake`` is then called, from any
        thread, once something is: the reader waits for that, then takes again); None
        once the outbox closed and everything before the close was taken."""
        if self._taken_all:
            return None
        self._wake = wake
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            self._waiting = True
            try:  # what came in before the reader was seen waiting would wake no one
                item = self._queue.get_nowait()
            except queue.Empty:
                return []
            self._waiting = False
        batch, self._taken_all = self._drain(item)
        return list(payloads(batch))

    def _drain(self, item: object) -> tuple[list[bytes], bool]:
        """The encoded messages of ``item`` and of everything queued after it, then the
        releases noted before; and whether the close was among them."""
        self._flushing = False
        # Taken before the queue is drained: a message that names a released handle was
        # put before the release, so it is in this batch, ahead of the releases.
        released = [self._released.popleft() for _ in range(len(self._released))]
        batch: list[bytes] = []
        closing = False
        while True:
            if item is self._CLOSE:
                closing = True
                break
            if type(item) is list:  # what a hold kept (send_held)
                batch.extend(map(encode_item, item))
            elif item is not self._FLUSH:
                batch.append(encode_item(item))
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        if released:
            assert self._releases is not None
            batch.append(encode_item(self._releases(released)))
        return batch, closing


RELEASE_SECONDS = 0.05  # how long a release waits for a batch to ride along with


class _ReleaseFlusher:
    """The one thread of a process that flushes its outboxes' releases, every
    RELEASE_SECONDS, started with the first outbox that takes releases."""

    def __init__(self) -> None:
        self._outboxes: "weakref.WeakSet[Outbox]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._pid = 0  # the process the thread runs in (a forked child starts its own)

    def watch(self, outbox: Outbox) -> None:
        with self._lock:
            self._outboxes.add(outbox)
            if self._pid != os.getpid():
                self._pid = os.getpid()
                # lives as long as its process, as the outboxes it flushes may
                threading.Thread(target=self._run, name="pathways-releases", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(RELEASE_SECONDS)
            with self._lock:
                outboxes = list(self._outboxes)
            for outbox in outboxes:
                outbox.flush()


_RELEASE_FLUSHER = _ReleaseFlusher()


# What a stream's outbox may hold unsent, in messages and in their encoded bytes, before the
# stream stops reading its peer's requests (``LoopOutbox.room``): a peer that sends without
# reading its replies gets no more served until it does, instead of growing the server's
# memory. The count bounds many small replies; the bytes bound a few large ones (an Error's
# text may be MAX_TEXT, 64 KiB: 10,000 of those would hold 640 MiB). 16 MiB is more than
# 10,000 usual replies take (a few hundred bytes each), so the count stays the bound that an
# ordinary backlog meets, and about 250 replies of the largest text.
MAX_QUEUED_MESSAGES = 10_000
MAX_QUEUED_BYTES = 16 << 20


class LoopOutbox:
    """The messages waiting for one stream served on an event loop; used only from that loop.

    ``put`` encodes a message (its size is known from then on, and the writer only joins
    what was encoded), appends it and wakes the stream's writer, which sends whatever has
    queued by the time it runs as one payload (several where one would be too large:
    ``payloads``): everything one inbound batch caused goes out together.
    While a payload waits for the peer to take it (flow control), later messages queue
    here; ``room`` is how the stream's reader waits until what is unsent, queued or being
    sent, is below both bounds again.
    """

    __slots__ = ("_items", "_unsent", "_unsent_bytes", "_wake", "_closed", "_room")

    def __init__(self) -> None:
        self._items: list[bytes] = []  # encoded, not yet taken by the writer
        self._unsent = 0  # messages put and not yet sent: those queued and those being sent
        self._unsent_bytes = 0
        self._wake: Optional[asyncio.Future] = None
        self._closed = False
        self._room: Optional[asyncio.Future] = None

    async def room(self) -> None:
        """Return once fewer than MAX_QUEUED_MESSAGES messages and MAX_QUEUED_BYTES bytes of
        them are unsent (or it closed)."""
        while (self._unsent >= MAX_QUEUED_MESSAGES or self._unsent_bytes >= MAX_QUEUED_BYTES) and not self._closed:
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def _free(self) -> None:
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def put(self, message: Message) -> None:
        if self._closed:  # the stream is ending: nobody will send it
            return
        item = encode_item(message)
        self._items.append(item)
        self._unsent += 1
        self._unsent_bytes += len(item)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def close(self) -> None:
        """End the stream after whatever was put before."""
        self._closed = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._free()

    async def write_to(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send batches with ``send`` (a gRPC call's ``write``, or a framed socket's) until
        closed and drained, or until the stream ends. The stream's reader learns of an
        ended stream itself (EOF, a reset, or cancellation)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._items:
                if self._closed:
                    return
                self._wake = loop.create_future()
                await self._wake
                continue
            # the writer sends one batch at a time, so what is unsent now is exactly what it takes
            batch, self._items = self._items, []
            sending, sending_bytes = self._unsent, self._unsent_bytes
            try:
                for payload in payloads(batch):
                    await send(payload)
            except Exception:  # the stream ended under it (peer gone, server stopping): nothing more goes out
                self._closed = True
                self._items.clear()
                self._free()  # a reader waiting for room goes on, to find the stream's end
                return
            self._unsent -= sending
            self._unsent_bytes -= sending_bytes
            self._free()


class LocalStream:
    """One bidirectional stream between a client's threads and a server's asyncio loop in the
    same process, with no gRPC in between: to the client it is what a grpc stream_stream call
    returns (an iterator of reply payloads, ``cancel()``); to the server's handler it is what
    grpc.aio's ServicerContext is (``read``, ``write``, ``abort``).

    The server's reads take the client's Outbox directly (``Outbox.take``), on the loop:
    each read is everything the client queued since the last one, as one batch, and a
    server that stops reading (its backpressure) leaves the client's messages queued, as a
    gRPC stream's flow control would. A read that finds nothing waits for the client's next
    put to wake it; no thread stands in between. Replies queue at most LOCAL_IN_FLIGHT deep
    before the server's writes wait for the client."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self._loop = loop
        self._outbox = outbox
        self._taken: collections.deque[bytes] = collections.deque()  # payloads taken, not yet read
        self._ended = False  # the requests ended: the outbox closed, or the client cancelled
        self._put: Optional[asyncio.Future] = None  # what a read that found nothing waits on
        self._replies: queue.Queue = queue.Queue()  # its writes wait while LOCAL_IN_FLIGHT are unread
        self._cancelled = threading.Event()

    # ---- the client's side ----------------------------------------------------------------

    def _wake(self) -> None:
        """Something was put (or the stream cancelled): a read waiting for it goes on. From
        any thread."""
        try:
            self._loop.call_soon_threadsafe(self._woken)
        except RuntimeError:  # the loop closed: the server is gone
            self._cancelled.set()

    def _woken(self) -> None:
        if self._put is not None and not self._put.done():
            self._put.set_result(None)

    def __iter__(self) -> "LocalStream":
        return self

    def __next__(self) -> bytes:
        item = self._replies.get()
        if item is self._END:
            self._replies.put(item)  # every later call ends too
            raise StopIteration
        if isinstance(item, BaseException):
            self._replies.put(self._END)
            raise item
        return item

    def cancel(self) -> None:
        """End the stream from the client's side: the server sees the requests end."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()
        self._replies.put(self._END)

    # ---- the server's side (on the loop) --------------------------------------------------

    async def read(self) -> object:
        """The next request payload, or grpc.aio.EOF once the client's requests ended."""
        while not self._taken:
            if self._ended or self._cancelled.is_set():
                return grpc.aio.EOF
            try:
                taken = self._outbox.take(self._wake)
            except Exception as e:  # a message the client put does not encode: the stream ends
                self._replies.put(e)
                self._ended = True
                continue
            if taken is None:
                self._ended = True
            elif taken:
                self._taken.extend(taken)
            else:
                self._put = self._loop.create_future()
                if not self._cancelled.is_set():
                    await self._put
                self._put = None
        return self._taken.popleft()

    async def write(self, payload: bytes) -> None:
        while self._replies.qsize() >= LOCAL_IN_FLIGHT and not self._cancelled.is_set():
            await asyncio.sleep(0.001)  # the client's reader is behind: wait for it, not the loop
        if not self._cancelled.is_set():
            self._replies.put(payload)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.finish(ConnectError(f"{code.name}: {details}"))
        raise asyncio.CancelledError

    def finish(self, error: Optional[BaseException] = None) -> None:
        """The server's handler ended: the client's iterator ends (raising ``error`` if given)."""
        if error is not None:
            self._replies.put(error)
        self._replies.put(self._END)


LOCAL_IN_FLIGHT = 256  # reply payloads a LocalStream holds before the server's writes wait
