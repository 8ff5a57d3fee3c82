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
  is bounded: what was alive at that moment.
- ``gc_freeze_interval`` (0, off, by default): the same every ``interval`` events, so
  no collection walks more than one interval's objects, whatever the process keeps.
  Unbounded over a long run (see the price below), hence opt-in.

Neither freezes anything in a process that had frozen objects itself before its first
controller opened (``gc.get_freeze_count() > 0``): it manages its own freezes, and the
last close's ``gc.unfreeze()`` would undo them. If the process freezes objects while a
controller holds the freeze, the last close sees the count above what the controllers
froze, leaves everything frozen and logs a warning (a freeze made after some frozen
objects died can go unseen: a process that uses ``gc.freeze()`` should turn both off).

Frozen objects are also missing from ``gc.get_objects()`` and ``gc.get_referrers()``
until the unfreeze. The price: an object frozen while alive that later becomes
unreachable *inside a reference cycle* is only reclaimed after ``gc.unfreeze()``.
Objects freed by reference counting (the rollout state's groups and siblings, events,
rows, most of what a process drops) are freed as usual. The freeze is process-wide;
the last controller holding it to close calls ``gc.unfreeze()``, so a process that
closes its controllers gets everything collectable again.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

# Process-wide, like the collector itself. Reentrant: a finalizer run by a collection
# may close a controller on the same thread.
_lock = threading.RLock()
_holders = 0  # open freezers holding the process's freeze
_owned = False  # nothing was frozen before the first holder: the holders may freeze
_count_after = 0  # gc.get_freeze_count() right after the holders' latest freeze


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
        """Whether this freezer holds a share of the process's freeze (the last holder to
        close unfreezes)."""
        return self._holding

    def start(self, seq: int) -> None:
        """At open or restore: take a share of the process's freeze and freeze now if this
        is its first holder (``at_open``) or an interval is set; count the interval from
        ``seq``."""
        if self.interval <= 0 and not self.at_open:
            return
        first = self._hold()
        if first or self.interval > 0:
            self._freeze(seq)

    def after(self, seq: int) -> None:
        """Called with the newest offset after each command; freezes when due."""
        if self.interval <= 0:
            return
        if self._since is None or seq - self._since >= self.interval:
            self._freeze(seq)

    def _hold(self) -> bool:
        """Take a share; True if this is the first holder (it decides whether the
        process's freeze is the holders' to make)."""
        global _holders, _owned
        with _lock:
            if self._holding:
                return False
            self._holding = True
            _holders += 1
            if _holders > 1:
                return False
            _owned = gc.get_freeze_count() == 0
            if not _owned:
                log.info("the process froze objects itself: controllers freeze nothing")
            return True

    def _freeze(self, seq: int) -> None:
        global _count_after
        self._since = seq
        if not _owned:
            return  # the process manages its own freezes
        started = time.perf_counter()
        # Outside the lock: finalizers run here. Only what is new since the last freeze
        # is walked.
        gc.collect()
        with _lock:
            gc.freeze()
            _count_after = gc.get_freeze_count()
        self.freezes += 1
        self.max_freeze_s = max(self.max_freeze_s, time.perf_counter() - started)

    def close(self) -> None:
        """Give back the share; the last holder gives the frozen objects back to the
        collector, unless the process froze objects itself (see the module docstring)."""
        global _holders, _owned
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _holders -= 1
            if _holders > 0 or not _owned:
                return
            _owned = False
            if gc.get_freeze_count() > _count_after:
                log.warning(
                    "objects were frozen outside rolloutlog while a controller held the "
                    "freeze: leaving everything frozen (set store.gc_freeze_at_open: false "
                    "and gc_freeze_interval: 0 in a process that calls gc.freeze())"
                )
                return
            gc.unfreeze()
