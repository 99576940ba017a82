"""One TLS socket read by one thread and written by another (a worker's stream to its
controller): the stream stays whole both ways, and silence ends a read in time."""

import asyncio
import socket
import ssl
import threading
import time

import pytest

from pathways.wire.certs import make_certificates
from pathways.wire.frames import FrameReader, frame, read_frame
from pathways.wire.tls_socket import SharedTlsSocket


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certificates(str(d), ["127.0.0.1"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "cert.pem", d / "key.pem")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(d / "ca.pem")
    return server, client


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * ((i * 7919) % 3000 + 1)


def _serve_tls(context, done, on_listening, errors, received):
    """An asyncio TLS server, as the controller is: it writes frames as fast as it can
    and checks every frame it reads, until ``done`` is set."""
    async def handle(reader, writer):
        async def read():
            n = 0
            try:
                while (payload := await read_frame(reader, 1 << 20, 10)) is not None:
                    if payload != _payload(n):
                        errors.append(f"the server read a wrong frame {n}")
                        return
                    n += 1
                    received[0] = n
            except ConnectionError:
                pass
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(f"the server's read failed: {type(e).__name__}: {e}")

        async def write():
            i = 0
            try:
                while not writer.is_closing():
                    writer.write(frame(_payload(i)))
                    i += 1
                    if i % 50 == 0:
                        await writer.drain()
            except ConnectionError:
                pass

        writing = asyncio.create_task(write())
        await read()
        writing.cancel()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
        on_listening(server.sockets[0].getsockname()[1])
        await asyncio.to_thread(done.wait, 60)
        server.close()

    asyncio.run(main())


def test_a_reader_and_a_writer_thread_keep_the_stream_whole_both_ways(contexts):
    server_context, client_context = contexts
    seconds, errors, received, port = 3.0, [], [0], []
    listening, done = threading.Event(), threading.Event()
    server = threading.Thread(target=_serve_tls, args=(server_context, done, lambda p: (port.append(p),
                                                                                       listening.set()),
                                                        errors, received), daemon=True)
    server.start()
    try:
        assert listening.wait(10)
        sock = client_context.wrap_socket(socket.create_connection(("127.0.0.1", port[0])), server_hostname="127.0.0.1")
        shared = SharedTlsSocket(sock, 10.0)
        reader = FrameReader(shared)
        stop = time.monotonic() + seconds
        counts = {"read": 0, "written": 0}

        def read():
            try:
                while time.monotonic() < stop:
                    payload = reader.read(1 << 20)
                    if payload != _payload(counts["read"]):
                        errors.append(f"the client read {'the end' if payload is None else 'a wrong frame'} "
                                      f"after {counts['read']} frames")
                        return
                    counts["read"] += 1
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(f"the client's read failed: {type(e).__name__}: {e}")

        def write():
            try:
                while time.monotonic() < stop:
                    shared.sendall(frame(_payload(counts["written"])))
                    counts["written"] += 1
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(f"the client's write failed: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=read), threading.Thread(target=write)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 15)
        assert errors == []
        assert counts["read"] > 1000 and counts["written"] > 1000, counts
        deadline = time.monotonic() + 10
        while received[0] < counts["written"] and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
    finally:
        done.set()
        server.join(10)
    assert received[0] == counts["written"] and errors == []


def test_a_silent_peer_ends_a_read_after_the_timeout(contexts):
    server_context, client_context = contexts
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = []

        def accept():
            conn, _ = listener.accept()
            accepted.append(server_context.wrap_socket(conn, server_side=True))

        t = threading.Thread(target=accept)
        t.start()
        sock = client_context.wrap_socket(socket.create_connection(listener.getsockname()),
                                          server_hostname="127.0.0.1")
        t.join(10)
        try:
            began = time.monotonic()
            with pytest.raises(TimeoutError, match="no bytes arrived for 0.3 s"):
                FrameReader(SharedTlsSocket(sock, 0.3)).read(1 << 20)
            assert 0.25 < time.monotonic() - began < 5
        finally:
            sock.close()
            for conn in accepted:
                conn.close()
