"""One session's handle table: where each live array is, which were poisoned, and which
deletes wait for queued runs that still read them. Pure bookkeeping: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pathways.ir import Layout
from pathways.protocol.handles import HeldReleases


@dataclass
class HandleTable:
    live: dict[int, Layout] = field(default_factory=dict)  # handle -> where it lives
    poisoned: dict[int, tuple[str, str]] = field(default_factory=dict)  # handle -> (kind, message)
    _reads: HeldReleases[Layout] = field(default_factory=HeldReleases)  # queued runs reading each handle

    def poison(self, handles: Iterable[int], kind: str, message: str) -> None:
        for h in handles:
            self.poisoned[h] = (kind, message)

    def delete(self, handles: Iterable[int]) -> dict[int, Layout]:
        """Forget ``handles``; returns those whose buffers can be freed now (the others are
        freed once the queued runs reading them have been dispatched)."""
        doomed: dict[int, Layout] = {}
        for h in handles:
            self.poisoned.pop(h, None)
            layout = self.live.pop(h, None)
            if layout is not None and self._reads.release(h, layout):
                doomed[h] = layout
        return doomed

    def reads_queued(self, handles: Iterable[int]) -> None:
        self._reads.reading(handles)

    def reads_done(self, handles: Iterable[int]) -> dict[int, Layout]:
        """A run reading ``handles`` left the queue; returns the deletes it held back."""
        return self._reads.read_done(handles)

    def on_workers(self, workers: set[int]) -> list[int]:
        """The live handles with a buffer on any of ``workers``."""
        return [h for h, layout in self.live.items() if workers & set(layout.workers)]
