"""Heartbeats on a long-lived stream: when to send one, and when the peer has gone silent.

Pure: the clock is injected, so the shells (the controller's event loop, a worker's
threads) decide how to wait and this module only does the arithmetic. Each side of the
controller-worker stream tolerates ``timeout`` seconds of silence from its peer and tells
the peer so in its heartbeats; each side sends something (a batch of work, or a heartbeat
when nothing else went out) at least every fifth of the smaller of the two timeouts, so a
live peer is never mistaken for a silent one even when the two sides were started with
different timeouts, while a frozen process (SIGSTOP), a dead host or a cut cable is
noticed within the timeout: its kernel may still acknowledge TCP, but it sends nothing.
"""

from __future__ import annotations

import math
import time
from typing import Callable

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
