"""The minimum pace of received bytes (wire/pace.py) and the receive budget's shares per
party (tcp.Budget): pure, on a clock that jumps, and threads."""

import threading

import pytest

from pathways.wire import tcp
from pathways.wire.pace import Pace, TooSlow

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_trickle_is_cut_off_at_the_end_of_its_first_window_however_large_the_transfer():
    clock = Clock()
    pace = Pace("a 6 GB put", 6 << 30, rate=MIB, window=20.0, grace=10.0, clock=clock)
    for _ in range(2):  # a byte every 8 s
        clock.now += 8
        pace.arrived(1)
    clock.now += 8  # 24 s: the first window ended with 2 bytes of the 20 MiB it needed
    with pytest.raises(TooSlow, match=r"a 6 GB put came too slowly: 3 bytes in the last 20 s"):
        pace.arrived(1)


def test_a_transfer_that_keeps_the_pace_passes_whatever_its_size_and_a_slow_window_ends_it():
    clock = Clock()
    pace = Pace("an array", 100 * 20 * MIB, rate=MIB, window=20.0, grace=1.0, clock=clock)
    for _ in range(60):  # a minute at 1.5 MiB/s: each 20 s window brings 30 MiB
        clock.now += 1
        pace.arrived(3 * MIB // 2)
    assert pace.seconds_left() == pytest.approx(20.0)
    clock.now += 19
    pace.arrived(MIB)  # within the window: not judged yet
    clock.now += 2  # the window ended with 1 MiB of the 20 MiB it needed: earlier speed does not count
    with pytest.raises(TooSlow, match="1048576 bytes in the last 20 s"):
        pace.check()


def test_a_small_transfer_must_be_whole_within_its_grace_not_a_whole_window():
    clock = Clock()
    pace = Pace("a frame", 96, rate=MIB, window=20.0, grace=1.0, clock=clock)
    clock.now += 0.9
    pace.arrived(50)
    clock.now += 0.2
    with pytest.raises(TooSlow, match="51 of its 96 bytes in 1.1 s"):
        pace.arrived(1)


def test_bytes_announced_later_extend_the_deadline_and_a_whole_transfer_is_never_too_slow():
    clock = Clock()
    pace = Pace("a frame", 100, rate=MIB, window=20.0, grace=1.0, clock=clock)
    pace.arrived(100)
    pace.expect(4 * MIB)  # its pieces: 4 s more at the minimum rate
    clock.now += 4.5
    pace.arrived(4 * MIB)
    assert pace.complete
    clock.now += 1000
    pace.check()  # complete: nothing left to be slow about


def test_a_transfer_of_unknown_size_is_judged_by_its_windows_alone():
    clock = Clock()
    pace = Pace("a host buffer", None, rate=MIB, window=20.0, clock=clock)
    clock.now += 19
    pace.arrived(25 * MIB)
    clock.now += 2
    pace.check()  # the first window met its floor: the second begins
    assert pace.seconds_left() == pytest.approx(20.0)
    clock.now += 20
    with pytest.raises(TooSlow, match=r"0 bytes in the last 20 s \(26214400 so far\)"):
        pace.check()


def test_one_party_holds_at_most_its_share_and_the_others_get_the_rest():
    budget = tcp.Budget(100, share=0.5)
    trickler, honest = ("session", 7), ("session", 8)
    assert budget.reserve(40, 0.0, (trickler,)) is None
    refused = budget.reserve(20, 0.05, (trickler,))
    assert refused == "other frames of session 7 hold 40 of the 50 bytes it may hold here for longer than 0.05 s"
    assert budget.reserve(50, 0.0, (honest,)) is None, "the rest of the budget is the other parties'"
    assert budget.used == 90 and budget.held(trickler) == 40
    assert budget.reserve(60, 0.0, (("worker", 2),)) == "more than the 50 bytes that one worker 2 may hold here"
    assert budget.reserve(20, 0.05, (("worker", 2),)).startswith(
        "frames on other connections hold 90 of this listener's budget of 100 bytes")
    budget.release(40, (trickler,))
    assert budget.held(trickler) == 0 and budget.used == 50


def test_frames_of_no_bytes_come_and_go_in_any_order():
    """Empty arrays' frames of one party, reserved and released interleaved."""
    budget = tcp.Budget(100, share=0.5)
    party = ("session", 1)
    assert budget.reserve(0, 0.0, (party,)) is None
    assert budget.reserve(10, 0.0, (party,)) is None
    assert budget.reserve(0, 0.0, (party,)) is None
    budget.release(10, (party,))
    budget.release(0, (party,))
    budget.release(0, (party,))
    assert budget.used == 0 and budget.held(party) == 0


def test_a_party_waiting_for_its_share_gets_it_when_its_own_frame_ends():
    budget = tcp.Budget(100, share=0.5)
    party = ("worker", 1)
    assert budget.reserve(50, 0.0, (party,)) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.reserve(30, 10.0, (party,))))
    waiter.start()
    threading.Timer(0.1, budget.release, (50, (party,))).start()
    waiter.join(10)
    assert got == [None] and budget.held(party) == 30


def test_a_workers_listener_charges_peers_by_worker_and_the_front_ends_puts_by_session():
    from pathways.protocol.handles import first_handle
    from pathways.protocol.messages import CONTROLLER_SENDER
    from pathways.worker.peers import frame_parties

    assert frame_parties(3, {"handle": 17}) == (("worker", 3),)
    assert frame_parties(CONTROLLER_SENDER, {"handle": first_handle(42) + 5}) == (("session", 42),)
    assert frame_parties(CONTROLLER_SENDER, {"handle": "?"}) == (("controller", CONTROLLER_SENDER),)
    assert frame_parties(None, {"handle": 1}) == ()
