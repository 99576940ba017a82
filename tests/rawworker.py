"""A fake worker for tests: the controller's worker stream (framed TCP) driven by hand,
with raw payloads or raw bytes, from the test's thread."""

import socket
import threading
import time

from pathways.protocol import messages as m, operator
from pathways.wire import frames, rpc, tcp

TIMEOUT = 10.0


def attach_address(controller: str, timeout: float = TIMEOUT, security=None) -> str:
    """The ``tcp://HOST:PORT`` where the controller at ``controller`` (grpc://...) takes workers."""
    channel = rpc.open_channel(controller, security)
    try:
        ask = rpc.method(channel, rpc.CONTROLLER_SERVICE, "AttachAddress", "unary_unary")
        return operator.answer(operator.ATTACH_REPLY, ask(b"", timeout=timeout)).address
    finally:
        channel.close()


class RawWorker:
    """One connection to a controller's worker port. Reads time out after ``timeout``. With
    ``security`` (a wire.security.Security) it greets the controller as a worker does (TLS
    when it has a CA, then the hello frame with its worker token, or its token where it has
    none); without, it sends no hello."""

    def __init__(self, address: str, timeout: float = TIMEOUT, security=None) -> None:
        if address.startswith("grpc://"):
            address = attach_address(address, timeout, security)
        self.sock = tcp.connect(address, timeout, security and security.for_attach(),
                                tls=security is not None and security.uses_tls)
        self.sock.settimeout(timeout)
        self.reader = frames.FrameReader(self.sock)
        self._sending = threading.Lock()  # whole frames, whichever thread sends
        self._closed = threading.Event()

    def send(self, payload: bytes) -> None:
        """One frame carrying ``payload`` (an encoded batch, or anything)."""
        with self._sending:
            self.sock.sendall(frames.frame(payload))

    def keep_alive(self, every: float = 1.0) -> None:
        """Send a heartbeat every ``every`` seconds from a thread until closed, as a live
        worker does, so that the controller does not drop it as silent."""
        def beat() -> None:
            while not self._closed.wait(every):
                try:
                    self.send_messages(m.Heartbeat(TIMEOUT))
                except OSError:
                    return
        threading.Thread(target=beat, daemon=True).start()

    def send_messages(self, *messages: m.Message) -> None:
        self.send(m.encode_batch(list(messages)))

    def read(self) -> list | None:
        """The next batch the controller sent, decoded; None once it closed the connection."""
        payload = self.reader.read(m.MAX_MESSAGE_BYTES)
        return None if payload is None else m.WORKER_DOWN.decode_batch(payload)

    def until(self, predicate, timeout: float = 60.0) -> list:
        """Decoded messages up to and including the first one ``predicate`` accepts."""
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = self.read()
            assert batch is not None, f"the controller closed the connection; got {got[-3:]} last"
            for msg in batch:
                got.append(msg)
                if predicate(msg):
                    return got
        raise AssertionError(f"no awaited reply within {timeout} s; got {len(got)} messages")

    def register(self, island: int | str, data_address: str = "tcp://127.0.0.1:1") -> int:
        """Register as a one-device worker, the one host of ``island``; returns the id it was given."""
        self.send_messages(m.Register("grpc://127.0.0.1:1", data_address, "cpu", 1, str(island), 1, None, "", 1,
                                      "fake", 1 << 30))
        return self.until(lambda x: type(x) is m.WorkerWelcome)[-1].worker

    def finish(self) -> list:
        """Stop sending, then read until the controller closes: every message it still sent."""
        self.sock.shutdown(socket.SHUT_WR)
        got = []
        while (batch := self.read()) is not None:
            got.extend(batch)
        return got

    def closed_by_peer(self, timeout: float) -> bool:
        """Whether the controller closed the connection (EOF or reset) within ``timeout``
        seconds, discarding whatever it sent before."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except ConnectionResetError:
                return True
            except (socket.timeout, TimeoutError):
                return False
        return False

    def drain(self) -> None:
        """Read on, as a live worker would, so that the stream never backs up, until closed
        (by the controller, or by ``close``): call it on a thread."""
        self.sock.settimeout(None)
        try:
            while self.read() is not None:
                pass
        except (OSError, ValueError):
            pass  # close() shut the connection

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in drain()
        except OSError:
            pass  # the controller closed it already
        self.reader.close()
        self.sock.close()

