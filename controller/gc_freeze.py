"""Keeping a large heap out of CPython's full garbage collections (opt-in).

CPython's generation-2 collection walks every tracked object of the process, and it
runs on whatever thread allocates when its threshold trips, so on the event loop that
drives the run. The rollout state's groups and siblings are not tracked (see
``domain/untracked.py``: 100k groups of 16 siblings were 1.8M objects, a 300-570 ms
collection); what a collection still walks is the rest of the process: its modules,
the events and rows in flight, and whatever the caller holds.
``gc.freeze()`` moves every object alive at that moment into a permanent generation
that collections skip. :class:`HeapFreezer` does ``gc.collect()`` (which then
only walks what was made since the previous freeze) and ``gc.freeze()`` once every
``interval`` events, so no collection walks more than one interval's objects.

The price, and why it is opt-in (``StoreConfig.gc_freeze_interval``): an object frozen
while alive that later becomes unreachable *inside a reference cycle* is only reclaimed
after ``gc.unfreeze()``. Objects freed by reference counting (the rollout state's groups
and siblings, events, rows) are freed as usual. The freeze is process-wide; the last
controller with freezing on to close unfreezes, so a process that closes its
controllers gets everything collectable again.
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_holders = 0  # open freezers that have frozen at least once


class HeapFreezer:
    """Collect-then-freeze every ``interval`` events (0: never) for one controller."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._since: int | None = None
        self._holding = False
        #: Freezes done, and the longest one took (seconds, collection included).
        self.freezes = 0
        self.max_freeze_s = 0.0

    def start(self, seq: int) -> None:
        """Freeze now (at open or restore, where one full collection is part of the
        opening) and count the interval from offset ``seq``."""
        if self.interval > 0:
            self._freeze(seq)

    def after(self, seq: int) -> None:
        """Called with the newest offset after each command; freezes when due."""
        if self.interval <= 0:
            return
        if self._since is None or seq - self._since >= self.interval:
            self._freeze(seq)

    def _freeze(self, seq: int) -> None:
        global _holders
        self._since = seq
        started = time.perf_counter()
        with _lock:
            if not self._holding:
                self._holding = True
                _holders += 1
            gc.collect()  # only the objects made since the last freeze are walked
            gc.freeze()
        self.freezes += 1
        self.max_freeze_s = max(self.max_freeze_s, time.perf_counter() - started)

    def close(self) -> None:
        """Give the frozen objects back to the collector when no other freezer holds them."""
        global _holders
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()
