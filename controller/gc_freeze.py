"""Keeping the process's heap out of CPython's full garbage collections.

CPython's generation-2 collection walks every tracked object of the process, and it
runs on whatever thread allocates when its threshold trips, so on the event loop that
drives the run. The rollout state's groups and siblings are not tracked (see
``domain/untracked.py``: 100k groups of 16 siblings were 1.8M objects, a 300-570 ms
collection); what a collection still walks is the rest of the process: its modules
(SQLAlchemy, pydantic, alembic: about 80k objects here, a 13-25 ms collection), the
events and rows in flight, and whatever the caller holds. A full collection that trips
inside a long command adds its time to the command's.

``gc.freeze()`` moves every object alive at that moment into a permanent generation that
collections skip. :class:`HeapFreezer` uses it two ways, both set in ``StoreConfig``:

- ``gc_freeze_at_open`` (on by default): one ``gc.collect()`` and ``gc.freeze()`` when
  the first controller of the process opens, so the heap the process built before the
  run (its imports, the model, the dataset) is never walked again. What it holds back
  is bounded: what was alive at that moment. It is skipped when the process froze
  objects itself (``gc.get_freeze_count() > 0``): it manages its own freezes, and the
  unfreeze below would undo them.
- ``gc_freeze_interval`` (0, off, by default): the same every ``interval`` events, so
  no collection walks more than one interval's objects, whatever the process keeps.
  Unbounded over a long run (see the price below), hence opt-in.

The price: an object frozen while alive that later becomes unreachable *inside a
reference cycle* is only reclaimed after ``gc.unfreeze()``. Objects freed by reference
counting (the rollout state's groups and siblings, events, rows, most of what a
process drops) are freed as usual. The freeze is process-wide; the last controller
holding it to close calls ``gc.unfreeze()``, so a process that closes its controllers
gets everything collectable again.
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_holders = 0  # open freezers holding the process's freeze
_owned = False  # the process's frozen objects are ours to unfreeze


class HeapFreezer:
    """One controller's share of the process-wide freeze (see the module docstring).

    ``at_open``: collect and freeze once, when the first holder of the process opens.
    ``interval`` (events; 0: never): collect and freeze again every so many events.
    """

    def __init__(self, interval: int, *, at_open: bool = False) -> None:
        self.interval = interval
        self.at_open = at_open
        self._since: int | None = None
        self._holding = False
        #: Freezes this freezer did, and the longest one took (seconds, collection
        #: included).
        self.freezes = 0
        self.max_freeze_s = 0.0

    @property
    def holding(self) -> bool:
        """Whether this freezer holds the process's freeze (it unfreezes on the last close)."""
        return self._holding

    def start(self, seq: int) -> None:
        """At open or restore: join the process's freeze, freezing where this is the first
        holder (or on every open with an interval), and count the interval from ``seq``."""
        if self.interval > 0:
            self._freeze(seq)
        elif self.at_open:
            self._join()

    def after(self, seq: int) -> None:
        """Called with the newest offset after each command; freezes when due."""
        if self.interval <= 0:
            return
        if self._since is None or seq - self._since >= self.interval:
            self._freeze(seq)

    def _join(self) -> None:
        global _holders, _owned
        started = time.perf_counter()
        with _lock:
            if self._holding:
                return
            if _holders == 0:
                if gc.get_freeze_count() > 0:
                    return  # the process manages its own freezes: leave them alone
                gc.collect()  # what is garbage now is not held back
                gc.freeze()
                _owned = True
                self.freezes += 1
            self._holding = True
            _holders += 1
        self.max_freeze_s = max(self.max_freeze_s, time.perf_counter() - started)

    def _freeze(self, seq: int) -> None:
        global _holders, _owned
        self._since = seq
        started = time.perf_counter()
        with _lock:
            if not self._holding:
                if _holders == 0:
                    _owned = gc.get_freeze_count() == 0
                self._holding = True
                _holders += 1
            gc.collect()  # only the objects made since the last freeze are walked
            gc.freeze()
        self.freezes += 1
        self.max_freeze_s = max(self.max_freeze_s, time.perf_counter() - started)

    def close(self) -> None:
        """Leave the freeze; the last holder gives the frozen objects back to the collector
        (unless the process had frozen objects of its own before the first holder)."""
        global _holders, _owned
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _holders -= 1
            if _holders == 0:
                if _owned:
                    gc.unfreeze()
                _owned = False
