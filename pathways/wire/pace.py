"""The minimum pace of bytes being received: one rule for every receiver that holds memory
for a sender while its bytes come (a worker's data listener, the IFRT front end's host
buffers).

A transfer's bytes must arrive at ``rate`` bytes per second at least, judged over
consecutive windows of ``window`` seconds: by the end of each window, ``rate * window``
more bytes (or all that were still missing) must have come since the window began. A
sender that trickles its bytes is cut off at the end of the first window it was slow in,
however large the transfer it announced, so that it holds what it reserved for about
``window`` seconds (plus a read's timeout) at most; a transfer of any size that keeps the
pace passes. Earlier speed does not make up for a slow window: an average since the start
would let a sender that sent fast, then stopped, hold its memory for as long again.

A transfer of known size must also be whole within ``grace`` seconds plus its size at
``rate``, so that a small one is judged before its first window ends.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from pathways.errors import WireError

MIN_RATE = 1 << 20  # bytes per second
WINDOW_SECONDS = 20.0


class TooSlow(WireError):
    """A transfer's bytes came slower than the minimum pace; its receiver drops it."""


class Pace:
    """The pace of one transfer of ``total`` bytes (None: not known). ``expect`` adds
    bytes announced later; ``arrived`` counts bytes in, and raises TooSlow once the
    transfer fell behind. ``clock``: time.monotonic, or a test's."""

    __slots__ = ("what", "rate", "window", "_clock", "_total", "received", "_began", "_deadline", "_since",
                 "_floor", "_window_end")

    def __init__(self, what: str, total: Optional[int] = None, rate: float = MIN_RATE,
                 window: float = WINDOW_SECONDS, grace: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.rate = rate
        self.window = window
        self._clock = clock
        self._total = total
        self.received = 0
        self._began = clock()
        self._deadline = None if total is None else self._began + grace + total / rate
        self._begin_window(self._began)

    def _begin_window(self, now: float) -> None:
        """By the end of a window beginning ``now``, the bytes received must reach its floor."""
        step = self.rate * self.window
        if self._total is not None:
            step = min(step, self._total - self.received)
        self._since = self.received  # bytes received when the window began
        self._floor = self.received + step
        self._window_end = now + self.window

    @property
    def complete(self) -> bool:
        return self._total is not None and self.received >= self._total

    def expect(self, nbytes: int) -> None:
        """``nbytes`` more are announced (a frame's pieces, once its header is read)."""
        if self._total is not None and self._deadline is not None:
            self._total += nbytes
            self._deadline += nbytes / self.rate
            self._floor = min(self._since + self.rate * self.window, self._floor + nbytes)

    def arrived(self, nbytes: int) -> None:
        """``nbytes`` more came; TooSlow if the transfer fell behind."""
        self.received += nbytes
        self.check()

    def check(self) -> None:
        """TooSlow if the transfer is past its deadline, or its current window ended short
        of the floor; else, once a window has ended, the next one begins."""
        if self.complete:
            return
        now = self._clock()
        if self._deadline is not None and now > self._deadline:
            raise TooSlow(f"{self.what} came too slowly: {self.received} of its {self._total} bytes in "
                          f"{now - self._began:.1f} s, below the minimum pace of {self.rate:.0f} bytes/s that a "
                          "receiver holding memory for it requires; send from a source that keeps up, over a "
                          "faster link")
        if now < self._window_end:
            return
        if self.received < self._floor:
            of = "" if self._total is None else f" of {self._total}"
            raise TooSlow(f"{self.what} came too slowly: {self.received - self._since} bytes in the last "
                          f"{self.window:g} s ({self.received}{of} so far), below the minimum pace of "
                          f"{self.rate:.0f} bytes/s that a receiver holding memory for it requires; send from a "
                          "source that keeps up, over a faster link")
        self._begin_window(now)

    def seconds_left(self) -> float:
        """Until the pace must next be checked (the current window's end, or the deadline):
        how long a receiver may wait for the next bytes before it looks again."""
        end = self._window_end if self._deadline is None else min(self._window_end, self._deadline)
        return max(0.0, end - self._clock())
