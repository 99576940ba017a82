"""Heartbeats on a long-lived stream: when to send one, when the peer has gone silent, and
whether a silent peer is slow or lost.

Pure: the clock and the kernel's view of the connection are injected, so the shells (the
controller's event loop, a worker's threads) decide how to wait and what to ask the kernel,
and this module only does the arithmetic. Each side of the controller-worker stream
tolerates ``timeout`` seconds of silence from its peer and tells the peer so in its
heartbeats; each side sends something (a batch of work, or a heartbeat when nothing else
went out) at least every fifth of the smaller of the two timeouts, so that a live peer is
not taken for a silent one even when the two sides were started with different timeouts.

Slow is not lost. A peer's heartbeats can be late for reasons that say nothing about
whether it is still there: measured on a 2-core machine, with 100 busy processes beside a
local cluster at a 2 s timeout, heartbeats both ways arrived up to 9.1 s late (a Python
thread must be scheduled to send one, and another to read it; a thread beside XLA compiles
paused no longer than another process did, at most 0.38 s against 0.35 s: the compiles
release the GIL, and what delays a heartbeat is the CPU's scheduling, which no thread of the
process can escape), so that taking silence alone for loss would lose a host within seconds,
and again after each restart. A loop that was itself starved may also look before it has
read what arrived: what reached the kernel counts as heard (``Heartbeats.heard_ago``).

So a peer silent for the timeout is judged by what the kernel knows of its connection
(``judge``, with a ``TcpState`` from Linux's TCP_INFO): data that has reached this host's
kernel is no silence; a peer whose host still acknowledges what this side sends (its process
alive, however starved, stopped or busy) is *slow*, and kept; one whose host has acknowledged
nothing for the timeout while this side's kernel retries (a cut cable, a dead host: no FIN
ever comes) is *lost*. Since each side sends at least every fifth of the timeout, a cut is
judged lost within about 1.4 timeouts of the last thing heard; a cut of a peer that had
stopped reading with its buffers full is seen only once two window probes go unanswered,
and the kernel spaces those further apart the longer the window stays closed (up to 2
minutes). Where the kernel says nothing (not Linux), silence alone is lost. What
bounds a slow peer's work is the controller's run timeout, not its heartbeats: a stopped
(SIGSTOP) process is slow.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

# How many heartbeats fit in the peer's timeout: a few may be late (a busy host, a
# scheduling hiccup) before the peer gives up.
BEATS_PER_TIMEOUT = 5
# The shortest pause between heartbeats, whatever timeout a peer announces: a peer cannot
# make this side flood the stream.
MIN_INTERVAL = 0.01


def check_timeout(seconds: float, what: str = "--heartbeat-timeout") -> float:
    """``seconds`` if it is a finite number above 0; else ValueError naming ``what``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds)
                                                                                  and seconds > 0):
        raise ValueError(f"{what} must be a finite number of seconds above 0, got {seconds!r}")
    return float(seconds)


class Heartbeats:
    """One stream's liveness: when its peer was last heard from, when something was last
    sent to it, and what silence the peer tolerates (learned from its heartbeats)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = check_timeout(timeout, "the heartbeat timeout")
        self.peer_timeout = self.timeout  # until the peer says otherwise
        self._clock = clock
        self.last_heard = self.last_sent = clock()

    def heard(self) -> None:
        """Something arrived from the peer."""
        self.last_heard = self._clock()

    def heard_ago(self, seconds: float) -> None:
        """Something from the peer reached this host ``seconds`` ago (its kernel says so),
        whether or not this process has read it yet: no silence before then."""
        self.last_heard = max(self.last_heard, self._clock() - seconds)

    def sent(self) -> None:
        """Something went out to the peer."""
        self.last_sent = self._clock()

    def learn(self, peer_timeout: float) -> None:
        """The peer gives up after ``peer_timeout`` seconds of silence."""
        self.peer_timeout = check_timeout(peer_timeout, "a peer's heartbeat timeout")

    @property
    def interval(self) -> float:
        """The longest this side stays quiet."""
        return max(MIN_INTERVAL, min(self.timeout, self.peer_timeout) / BEATS_PER_TIMEOUT)

    def beat_due(self) -> bool:
        """Whether a heartbeat should go out now: nothing went out for an interval."""
        return self._clock() - self.last_sent >= self.interval

    def silent_for(self) -> float | None:
        """Seconds the peer has been silent, once that exceeds the timeout; else None."""
        quiet = self._clock() - self.last_heard
        return quiet if quiet > self.timeout else None

    def until_beat(self) -> float:
        """Seconds until a heartbeat falls due (at least a millisecond, so that a caller's
        loop cannot spin)."""
        return max(1e-3, self.last_sent + self.interval - self._clock())

    def until_silent(self) -> float:
        """Seconds until the peer counts as silent if nothing arrives meanwhile (at least a
        millisecond)."""
        return max(1e-3, self.last_heard + self.timeout - self._clock())


@dataclass(frozen=True)
class TcpState:
    """What this host's kernel knows of a TCP connection (tcp.tcp_state reads it)."""

    open: bool  # established: neither side has closed or reset it
    heard: float  # seconds since data from the peer last reached this host's kernel
    acked: float  # seconds since the peer's kernel last acknowledged anything
    # this side's kernel resends data the peer has not acknowledged, or probes its closed
    # window without an answer (a peer that reads nothing but is there answers the probes,
    # which the kernel sends further and further apart, up to 2 minutes)
    retrying: bool


class Verdict(enum.Enum):
    ANSWERING = "answering"  # heard within the timeout
    SLOW = "slow"  # silent past the timeout, but its host still acknowledges: keep it
    LOST = "lost"  # silent past the timeout, and its host or the path to it is gone (or none can tell)


def judge(beats: Heartbeats, tcp: Optional[TcpState]) -> Verdict:
    """Whether ``beats``' peer answers, is slow or is lost, given what the kernel knows of
    its connection (``tcp``; None where the platform does not say, and then silence past
    the timeout is lost). What reached the kernel counts as heard (``beats`` learns it)."""
    if tcp is not None:
        beats.heard_ago(tcp.heard)
    if beats.silent_for() is None:
        return Verdict.ANSWERING
    if tcp is None or not tcp.open or (tcp.retrying and tcp.acked > beats.timeout):
        return Verdict.LOST
    return Verdict.SLOW
