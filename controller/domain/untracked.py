"""Keeping the groups and siblings of a rollout state out of CPython's cyclic collector.

A buffer of 100k groups of 16 siblings is 1.8M objects (each group, its sibling list and
its siblings). CPython's full collection walks every object its collector tracks: 570 ms
for that state on a small machine, and 50 ms with one sibling per group, on whatever
thread allocates when the threshold trips, so on the event loop that drives the run.

The collector only exists to find reference cycles, and these objects cannot be in one:
a sibling holds only atoms (numbers, strings, ``None``, enum members), a group holds atoms
and the list of its siblings, and nothing they hold refers back to them. Reference
counting frees them as before. So each one is taken off the collector's lists when it is
made (``PyObject_GC_UnTrack``, CPython's public C API): a full collection then walks only
the rest of the process, whatever the size of the buffer.

What this changes for a user: ``gc.get_objects()`` and ``gc.get_referrers()`` no longer
list the state's groups and siblings. A copy made by ``copy.deepcopy`` (``RunState.copy``)
or by unpickling is tracked as usual (it is built without ``__init__``): correct, only
walked. Storing a container that refers back to a group in one of these fields would make
a cycle the collector cannot see, kept until the process ends; the fields are typed as
atoms so that nothing does. On an interpreter other than CPython this is a no-op.
"""

from __future__ import annotations

import ctypes
import gc
import platform
from collections.abc import Callable

__all__ = ["untrack"]


def _c_untrack() -> Callable[[object], None] | None:
    if platform.python_implementation() != "CPython":
        return None
    fn = ctypes.pythonapi.PyObject_GC_UnTrack
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    return fn


_UNTRACK = _c_untrack()


def untrack(obj: object) -> None:
    """Take ``obj`` off the cyclic collector's lists (it must not be part of a cycle).

    Safe on any object: one the collector does not track (an int, or one untracked
    already) is left alone. The C function itself may only be given a tracked one: it
    reads the collector's header, which other objects do not have. A no-op outside
    CPython.
    """
    if _UNTRACK is not None and gc.is_tracked(obj):
        _UNTRACK(obj)
