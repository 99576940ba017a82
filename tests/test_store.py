"""The worker's object store: a value wakes the threads waiting for its handle and no
others, waits are bounded, and a taken value leaves the store."""

import threading
import time

import numpy as np

from pathways.protocol.handles import first_handle
from pathways.worker.store import ObjectStore, Poison

SESSION = 3


def waiting(store, handle, results, still_wanted=lambda: True, timeout=30.0):
    """A thread waiting for ``handle``, its result appended to ``results``."""
    thread = threading.Thread(target=lambda: results.append(store.wait(handle, timeout, still_wanted)))
    thread.start()
    return thread


def registered(store, handle, count=1, timeout=10.0):
    """Wait until ``count`` threads wait for ``handle``."""
    deadline = time.monotonic() + timeout
    while len(store._waiters.get(handle, ())) < count:
        assert time.monotonic() < deadline, f"{count} waiter(s) for {handle:#x} never registered"
        time.sleep(0.005)


def test_a_put_wakes_only_the_waiters_of_its_handle():
    store = ObjectStore()
    a, b = first_handle(SESSION) + 1, first_handle(SESSION) + 2
    looks = []  # each time the waiter for b woke up and looked again
    got_a, got_b = [], []
    threads = [waiting(store, a, got_a), waiting(store, a, got_a),
               waiting(store, b, got_b, still_wanted=lambda: looks.append(1) or True)]
    registered(store, a, 2)
    registered(store, b)
    seen = len(looks)
    assert store.put(a, "A")
    threads[0].join(10)
    threads[1].join(10)
    assert got_a == ["A", "A"]
    assert len(looks) == seen and threads[2].is_alive(), "a value for another handle woke the waiter for b"
    store.put(b, "B")
    threads[2].join(10)
    assert got_b == ["B"]
    assert store._waiters == {}


def test_wake_has_every_waiter_look_again_and_an_unwanted_one_gives_up():
    store = ObjectStore()
    handle = first_handle(SESSION) + 1
    wanted = threading.Event()
    wanted.set()
    got = []
    thread = waiting(store, handle, got, still_wanted=wanted.is_set)
    registered(store, handle)
    wanted.clear()
    start = time.monotonic()
    store.wake()
    thread.join(10)
    assert got == [None] and time.monotonic() - start < 0.4  # sooner than the half-second recheck
    assert store._waiters == {}


def test_a_wait_ends_at_its_timeout_and_a_dropped_session_ends_it_with_poison():
    store = ObjectStore()
    start = time.monotonic()
    assert store.wait(first_handle(SESSION) + 1, 0.2) is None
    assert 0.2 <= time.monotonic() - start < 5.0
    got = []
    thread = waiting(store, first_handle(SESSION) + 2, got)
    registered(store, first_handle(SESSION) + 2)
    store.drop_session(SESSION)
    thread.join(10)
    assert type(got[0]) is Poison and "disconnected" in got[0].message
    assert store._waiters == {}


def test_a_taken_value_leaves_the_store_whether_it_was_there_or_arrived():
    store = ObjectStore()
    early, late = first_handle(SESSION) + 1, first_handle(SESSION) + 2
    store.put(early, "early")
    assert store.wait(early, 1.0, take=True) == "early" and store.get(early) is None
    got = []
    thread = threading.Thread(target=lambda: got.append(store.wait(late, 30.0, take=True)))
    thread.start()
    registered(store, late)
    store.put(late, "late")
    thread.join(10)
    assert got == ["late"] and store.get(late) is None and len(store) == 0


def test_a_transfer_copy_once_taken_drops_whatever_arrives_for_it_later():
    store = ObjectStore()
    copy, other, owned = first_handle(0) + 5, first_handle(0) + 6, first_handle(3) + 5
    store.put(copy, Poison("the sender's island was lost", "WorkerLostError"))
    assert isinstance(store.wait(copy, 1.0, take=True), Poison)
    assert not store.put(copy, np.ones(2)), "the sender's late bytes are dropped"
    assert not store.put(copy, Poison("lost", "WorkerLostError"), replace=False), "and whatever comes after them"
    store.put(other, np.ones(2))
    assert store.wait(other, 1.0, take=True) is not None
    assert not store.put(other, Poison("lost", "WorkerLostError"), replace=False), "so is a late poison"
    assert len(store) == 0
    store.put(owned, Poison("failed"))
    assert isinstance(store.wait(owned, 1.0, take=True), Poison)
    assert store.put(owned, np.ones(2)), "a session's own handles are not copies: no tombstone"


def test_a_transfer_copy_waited_for_in_vain_is_dropped_when_it_arrives_after_all():
    store = ObjectStore()
    copy, owned = first_handle(0) + 7, first_handle(SESSION) + 7
    assert store.wait(copy, 0.05, take=True) is None
    assert not store.put(copy, np.ones(2)) and len(store) == 0, "its reader gave up: nobody would take it"
    assert store.wait(owned, 0.05) is None
    assert store.put(owned, np.ones(2)), "a session's array may still arrive for a later fetch"


def test_a_transfer_copy_is_screened_in_only_from_its_expected_senders_once_each():
    store = ObjectStore()
    copy, stranger = first_handle(0) + 8, first_handle(0) + 9
    store.expect(0, [(copy, frozenset({1, 2}))])
    assert not store.screen(3, copy, 5.0), "a worker the run does not expect it from"
    assert store.screen(1, copy, 5.0) and not store.screen(1, copy, 5.0), "each sender's part once"
    assert store.screen(2, copy, 5.0)
    start = time.monotonic()
    assert not store.screen(1, stranger, 0.2) and time.monotonic() - start >= 0.2, "no run expects it: refused " \
                                                                                    "once the wait for its run ends"
    store.put(copy, np.ones(2))
    assert store.wait(copy, 1.0, take=True) is not None
    start = time.monotonic()
    assert not store.screen(1, copy, 5.0) and time.monotonic() - start < 1.0, "taken: refused at once"
    assert store._expected == {}, "a copy taken leaves no expectation behind"


def test_a_copy_pushed_before_its_run_is_known_is_screened_in_once_the_run_expects_it():
    store = ObjectStore()
    copy, forged = first_handle(0) + 10, first_handle(0) + 11
    results = {}
    threads = [threading.Thread(target=lambda h=h, s=s: results.setdefault((s, h), store.screen(s, h, 30.0)))
               for s, h in ((1, copy), (4, forged))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(store._screens) < 2:
        assert time.monotonic() < deadline, "the screens never waited"
        time.sleep(0.005)
    start = time.monotonic()
    store.expect(copy, [(0, frozenset({1})), (forged - copy, frozenset({2}))])
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - start < 5.0, "both screens woke when their copies were expected"
    assert results == {(1, copy): True, (4, forged): False} and store._screens == {}
