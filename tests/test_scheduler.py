"""The gang scheduler as a pure function of submissions and completions."""

from collections import Counter, deque

import pytest

from pathways.controller.scheduler import SOLO_FACTOR, ScheduledRun, Scheduler


def saturate(sched, weights, costs, completions):
    """Every session keeps work queued; the island finishes runs one at a time, oldest first.
    Returns the device time each session received."""
    for sid, w in weights.items():
        sched.add_session(sid, w)
    for sid in weights:
        for _ in range(sched.window * 2):
            sched.submit(ScheduledRun(sid, frozenset({0}), ("prog", sid)))
    flying: deque = deque(sched.dispatchable())
    device = Counter()
    for _ in range(completions):
        run = flying.popleft()
        device[run.session] += costs[run.session]
        sched.finish(run.id, costs[run.session])
        sched.submit(ScheduledRun(run.session, frozenset({0}), ("prog", run.session)))
        flying.extend(sched.dispatchable())
    return device


@pytest.mark.parametrize("weights", [{1: 1, 2: 1, 3: 1, 4: 1}, {1: 1, 2: 2, 3: 4, 4: 8}])
def test_fair_policy_splits_device_time_by_weight(weights):
    device = saturate(Scheduler("fair", window=4), weights, {s: 1e-3 for s in weights}, 3000)
    total = sum(device.values())
    for sid, w in weights.items():
        assert device[sid] / total == pytest.approx(w / sum(weights.values()), rel=0.02)


def test_fair_policy_counts_device_time_not_runs():
    # Session 2's runs cost three times as much; equal weights still mean equal device time.
    device = saturate(Scheduler("fair", window=2), {1: 1, 2: 1}, {1: 1e-3, 2: 3e-3}, 4000)
    assert device[1] / device[2] == pytest.approx(1.0, rel=0.03)


def test_fifo_releases_in_submission_order_within_the_window():
    sched = Scheduler("fifo", window=3)
    for sid in (1, 2):
        sched.add_session(sid)
    runs = [sched.submit(ScheduledRun(sid, frozenset({0}), "p")) for sid in (2, 1, 2, 1, 2, 1)]
    first = list(sched.dispatchable())
    assert first == runs[:3], "only a window's worth is in flight while sessions compete"
    assert sched.inflight(0) == 3 and sched.queued(0) == 3
    sched.finish(first[0].id, 1e-3)
    assert list(sched.dispatchable()) == [runs[3]]


def test_a_session_alone_may_run_ahead_a_few_windows():
    sched = Scheduler("fair", window=2)
    sched.add_session(1)
    sched.add_session(2)
    alone = [sched.submit(ScheduledRun(1, frozenset({0}), "p")) for _ in range(20)]
    assert list(sched.dispatchable()) == alone[:2 * SOLO_FACTOR], "nobody else waits: up to the solo bound"
    late = sched.submit(ScheduledRun(2, frozenset({0}), "p"))
    for run in alone[:2 * SOLO_FACTOR - 2]:
        sched.finish(run.id, 1e-3)
        assert list(sched.dispatchable()) == [], "over the window while another session waits"
    sched.finish(alone[2 * SOLO_FACTOR - 2].id, 1e-3)
    assert list(sched.dispatchable())[0] == late, "back within the window, the waiting session goes first"


def test_a_session_keeps_its_own_order():
    sched = Scheduler("fair", window=100)
    sched.add_session(1)
    runs = [sched.submit(ScheduledRun(1, frozenset({0}), i)) for i in range(10)]
    assert list(sched.dispatchable()) == runs


def test_an_idle_session_does_not_bank_credit():
    sched = Scheduler("fair", window=1)
    sched.add_session(1)
    sched.add_session(2)
    for _ in range(50):  # session 1 runs alone for a while
        sched.submit(ScheduledRun(1, frozenset({0}), "p"))
        (run,) = sched.dispatchable()
        sched.finish(run.id, 1e-3)
    for sid in (1, 2):
        for _ in range(20):
            sched.submit(ScheduledRun(sid, frozenset({0}), "p"))
    order = []
    for _ in range(20):
        (run,) = sched.dispatchable()
        order.append(run.session)
        sched.finish(run.id, 1e-3)
    assert 8 <= order.count(2) <= 12, f"session 2 should alternate with 1, not run 20 in a row: {order}"


def test_runs_on_several_islands_need_room_on_each():
    sched = Scheduler("fifo", window=1)
    sched.add_session(1)
    sched.add_session(2)
    a = sched.submit(ScheduledRun(1, frozenset({0}), "p"))
    both = sched.submit(ScheduledRun(2, frozenset({0, 1}), "q"))
    a2 = sched.submit(ScheduledRun(1, frozenset({0}), "p"))
    assert list(sched.dispatchable()) == [a], "island 0 is full, so the two-island run waits"
    sched.finish(a.id, 1e-3)
    assert list(sched.dispatchable()) == [both, a2], "then a2, alone in the queue, may run ahead"
    assert sched.inflight(0) == 2 and sched.inflight(1) == 1


def test_cancel_removes_queued_and_frees_in_flight_windows():
    sched = Scheduler("fifo", window=1)
    sched.add_session(1)
    sched.add_session(2)
    on0, next0 = (sched.submit(ScheduledRun(1, frozenset({0}), "p")) for _ in range(2))
    queued0 = sched.submit(ScheduledRun(2, frozenset({0}), "p"))
    on1 = sched.submit(ScheduledRun(2, frozenset({1}), "p"))
    assert list(sched.dispatchable()) == [on0, on1]  # island 0 is full; session 2's run on island 1 is not held
    queued, flying = sched.cancel(lambda r: 0 in r.islands)
    assert [r.id for r in queued] == [next0.id, queued0.id] and flying == [on0]
    assert sched.inflight(0) == 0 and sched.queued(0) == 0 and sched.inflight(1) == 1
    after = sched.submit(ScheduledRun(1, frozenset({0}), "p"))
    assert list(sched.dispatchable()) == [after]


def test_a_stalled_island_never_holds_up_a_sessions_runs_on_other_islands():
    """Island 0 stops reporting runs done (a frozen host): the session's runs queued behind
    it for island 0 wait, its runs on island 1 go on, and each island keeps the session's
    submission order."""
    sched = Scheduler("fair", window=2)
    sched.add_session(1)
    stuck = [sched.submit(ScheduledRun(1, frozenset({0}), "a")) for _ in range(2 * SOLO_FACTOR + 3)]
    both = sched.submit(ScheduledRun(1, frozenset({0, 1}), "b"))  # reads island 0's data: waits for island 0
    later = [sched.submit(ScheduledRun(1, frozenset({1}), "c")) for _ in range(3)]
    first = list(sched.dispatchable())
    assert first == stuck[:2 * SOLO_FACTOR], "island 0 fills up to the solo bound"
    sched.finish(first[0].id, 1e-3)
    assert list(sched.dispatchable()) == [stuck[2 * SOLO_FACTOR]]
    # the runs on island 1 must not pass `both`, which touches island 1 and came first
    assert sched.queued(1) == 4 and sched.inflight(1) == 0
    queued, _ = sched.cancel(lambda r: 0 in r.islands)  # island 0 is declared lost
    assert queued == [*stuck[2 * SOLO_FACTOR + 1:], both]
    assert list(sched.dispatchable()) == later, "island 1's runs go at once, in submission order"
    assert sched.session_stats(1)["queued"] == 0


def test_runs_on_disjoint_islands_interleave_in_each_islands_order():
    sched = Scheduler("fifo", window=1)
    sched.add_session(1)
    on0 = [sched.submit(ScheduledRun(1, frozenset({0}), "p")) for _ in range(SOLO_FACTOR + 1)]
    on1 = [sched.submit(ScheduledRun(1, frozenset({1}), "p")) for _ in range(SOLO_FACTOR + 1)]
    assert list(sched.dispatchable()) == on0[:SOLO_FACTOR] + on1[:SOLO_FACTOR]
    sched.finish(on1[0].id, 1e-3)
    assert list(sched.dispatchable()) == [on1[-1]], "island 1 moves on while island 0 is full"
    sched.finish(on0[0].id, 1e-3)
    assert list(sched.dispatchable()) == [on0[-1]]
    assert sched.session_stats(1)["queued"] == 0 and sched.session_stats(1)["inflight"] == 2 * SOLO_FACTOR


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="policy"):
        Scheduler("lifo")
    with pytest.raises(ValueError, match="window"):
        Scheduler("fair", window=0)
    with pytest.raises(ValueError, match="weight"):
        Scheduler().add_session(1, weight=0)


class _ScanningScheduler(Scheduler):
    """Every session looked at in every pick, and "another session has runs queued for the
    island" asked by scanning every session, as the definitions read: what the scheduler's
    index of queued sessions must agree with."""

    def _pick(self):
        best, best_key = None, ()
        for sid, s in self._sessions.items():
            run = self._next_of(sid, s)
            if run is not None:
                key = (run.id,) if self.policy == "fifo" else (s.vtime, run.id)
                if best is None or key < best_key:
                    best, best_key = run, key
        return best

    def _island_full(self, island, session):
        load = self._island_load.get(island, 0)
        if load < self.window:
            return False
        if load >= self.window * SOLO_FACTOR:
            return True
        return any(other != session and island in o.queues for other, o in self._sessions.items())


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_the_index_of_sessions_queued_per_island_releases_what_a_scan_would(policy):
    import random

    rng = random.Random(7)
    scheds = [Scheduler(policy, window=2), _ScanningScheduler(policy, window=2)]
    flying: list[list[ScheduledRun]] = [[], []]
    sessions: list[int] = []
    for step in range(3000):
        op, choice = rng.random(), rng.random()
        islands = frozenset(rng.sample(range(3), rng.choice([0, 1, 1, 1, 2])))
        if op < 0.05 or not sessions:
            sessions.append(step)
            act = lambda sched, i: sched.add_session(step, 1 + choice)  # noqa: E731
        elif op < 0.08:
            gone = sessions.pop(int(choice * len(sessions)))
            act = lambda sched, i: sched.remove_session(gone)  # noqa: E731
        elif op < 0.6:
            sid = sessions[int(choice * len(sessions))]
            act = lambda sched, i: sched.submit(ScheduledRun(sid, islands, ("p", step % 5)))  # noqa: E731
        elif op < 0.62:
            def act(sched, i):
                sched.cancel(lambda r: r.id % 7 == step % 7)
                flying[i] = [r for r in flying[i] if sched.running(r.id)]
        else:
            def act(sched, i):
                if flying[i]:
                    run = flying[i].pop(int(choice * len(flying[i])))
                    sched.finish(run.id, 1e-3 * (1 + run.id % 3))
        for i, sched in enumerate(scheds):
            act(sched, i)
            flying[i] += sched.dispatchable()
        assert [r.id for r in flying[0]] == [r.id for r in flying[1]], f"step {step}"
        recount = Counter(k for s in scheds[0]._sessions.values() for k in s.queues)
        assert {k: len(v) for k, v in scheds[0]._queued_by.items()} == dict(recount), f"step {step}"
