"""Threads that belong to an owner (pathways/threads.py): joined on close within a bound,
stragglers named; a data-plane listener's connections end with it."""

import logging
import socket
import threading
import time

from pathways.threads import Threads
from pathways.wire import tcp


def test_join_waits_for_every_thread_and_names_those_still_running(caplog):
    threads = Threads("a test owner")
    release = threading.Event()
    threads.start(release.wait, "quick", 10.0)
    threads.start(time.sleep, "stuck", 30.0)
    assert threads.running() == 2
    release.set()
    with caplog.at_level(logging.WARNING, logger="pathways"):
        started = time.monotonic()
        left = threads.join(timeout=0.3)
    assert left == ["stuck"] and 0.3 <= time.monotonic() - started < 2.0
    assert "a test owner closed with 1 thread(s) still running after 0.3 s: stuck" in caplog.text
    assert threads.running() == 1


def test_a_thread_that_closes_its_owner_does_not_wait_for_itself():
    threads = Threads("a test owner")
    joined = []
    threads.start(lambda: joined.append(threads.join(timeout=5.0)), "closer")
    deadline = time.monotonic() + 5
    while not joined and time.monotonic() < deadline:
        time.sleep(0.01)
    assert joined == [[]], "the closing thread skipped itself and returned at once"


def test_ended_threads_are_not_kept():
    threads = Threads("a test owner")
    for _ in range(50):
        threads.start(lambda: None, "short").join()
    threads.start(lambda: None, "last").join()
    assert len(threads._threads) == 1


def test_a_closed_listener_ends_its_idle_connections_and_joins_their_threads():
    listener = tcp.Listener(lambda *args: None, timeout=5.0)
    socks = [socket.create_connection(("127.0.0.1", listener.port), timeout=10) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while listener._threads.running() < 4 and time.monotonic() < deadline:  # accept + 3 connections
            time.sleep(0.01)
        assert listener._threads.running() == 4
        started = time.monotonic()
        listener.close()
        assert time.monotonic() - started < 2.0
        assert listener._threads.running() == 0
        for sock in socks:  # each peer sees its connection end
            assert sock.recv(1) == b""
    finally:
        for sock in socks:
            sock.close()


def test_threads_started_from_many_threads_at_once_are_all_kept_and_joined():
    threads = Threads("a test owner")
    release = threading.Event()
    starters = [threading.Thread(target=lambda: [threads.start(release.wait, "waiting", 30.0) for _ in range(50)])
                for _ in range(8)]
    for s in starters:
        s.start()
    for s in starters:
        s.join()
    assert threads.running() == 400, "a thread another caller had not started yet was forgotten"
    release.set()
    assert threads.join(timeout=10.0) == [] and threads.running() == 0
