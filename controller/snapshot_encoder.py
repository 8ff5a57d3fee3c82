"""Incremental state snapshots: the event loop never encodes the whole state at once.

A snapshot of a run with 100k buffered groups is tens of megabytes of JSON; encoding it
inside ``execute`` stopped the caller (the asyncio pump) for over a second. Most of those
groups do not change between two snapshots, so :class:`SnapshotEncoder` keeps each live
group's JSON and re-encodes only the groups that events touched since, a slice at a
time (at most ``slice_s`` seconds per command), until none is left; then it takes the
state's remaining fields and the list of group JSON texts (a consistent cut of the
state: the texts are immutable) and hands the rest, joining and compressing, to the
snapshot thread (zlib releases the GIL).

Which groups an event touches is the domain's rule: the group its audit keys name,
every group for the events in :data:`GROUP_WIDE_EVENTS`, and a group that leaves the
state is simply no longer listed. The bytes are exactly :func:`encode_snapshot`'s
(a test compares them after random command sequences).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterable

from .domain.events import RolloutEvent, RunRestored, RunResumed
from .domain.state import GroupState, RunState, group_plain

#: Events whose evolve changes every live group (a new epoch resets in-flight siblings).
GROUP_WIDE_EVENTS: tuple[type[RolloutEvent], ...] = (RunRestored, RunResumed)
_SEPARATORS = (",", ":")
#: Group texts per piece of the streamed snapshot (about 100 kB of JSON).
_FINISH_CHUNK = 512


def encode_snapshot(state: RunState) -> bytes:
    """Compressed JSON of the state (deterministic: sorted keys)."""
    raw = json.dumps(state.to_snapshot(), sort_keys=True, separators=_SEPARATORS)
    return zlib.compress(raw.encode(), 1)


def decode_snapshot(data: bytes) -> RunState:
    """The inverse of :func:`encode_snapshot`."""
    return RunState.from_snapshot(json.loads(zlib.decompress(data)))


def _group_json(group: GroupState) -> str:
    return json.dumps(group_plain(group), sort_keys=True, separators=_SEPARATORS)


class SnapshotEncoder:
    """Keeps the JSON of every live group of one state fresh, a slice at a time."""

    def __init__(self) -> None:
        # Ids to texts, and the ids to re-encode (a dict used as an ordered set): CPython
        # never tracks a dict of atoms (a set it always does), so a full collection does
        # not visit one entry per group.
        self._texts: dict[int, str] = {}
        self._dirty: dict[int, None] = {}
        self._all_dirty = True  # nothing encoded yet

    def touched(self, events: Iterable[RolloutEvent]) -> None:
        """Note the groups ``events`` change (call after applying them)."""
        for event in events:
            if isinstance(event, GROUP_WIDE_EVENTS):
                self._all_dirty = True
                continue
            group_id = event.audit_keys().group_id
            if group_id is not None:
                self._dirty[group_id] = None

    def refresh(self, state: RunState, slice_s: float | None = None) -> bool:
        """Re-encode touched groups for at most ``slice_s`` seconds (None: all of them),
        and at least 32 of them (so a zero slice still progresses); True when every live
        group's JSON is current."""
        if self._all_dirty:
            self._dirty = dict.fromkeys(state.groups)
            self._all_dirty = False
        deadline = None if slice_s is None else time.perf_counter() + slice_s
        dirty, texts, groups = self._dirty, self._texts, state.groups
        done = 0
        while dirty:
            group_id, _ = dirty.popitem()
            group = groups.get(group_id)
            if group is None:
                texts.pop(group_id, None)
            else:
                texts[group_id] = _group_json(group)
            done += 1
            # Check the clock every 32 groups: reading it costs more than a small group.
            if deadline is not None and done % 32 == 0 and time.perf_counter() >= deadline:
                break
        return not dirty

    def cut(self, state: RunState) -> Callable[[], bytes]:
        """A consistent cut of ``state`` (after :meth:`refresh` returned True), and the
        function that turns it into the snapshot's bytes (safe to call on another thread:
        it reads only what the cut copied)."""
        if self._all_dirty or self._dirty:
            raise RuntimeError("refresh() the encoder until it returns True before cut()")
        texts = self._texts
        # A tuple of strings: CPython untracks it at the first collection that sees it.
        group_texts = tuple([texts[group_id] for group_id in state.groups])
        if len(texts) > 2 * len(group_texts) + 1024:  # forget groups that left the state
            self._texts = {group_id: texts[group_id] for group_id in state.groups}
        head = state.to_snapshot(groups=False)

        def finish() -> bytes:
            # Streamed through one deflate stream in small pieces: deflate runs without
            # the GIL, and no single join or encode of a 100k-group state (tens of MB,
            # tens of ms in one C call) keeps the caller's thread from running. The bytes
            # are those of zlib.compress(whole, 1).
            deflate = zlib.compressobj(1)
            out: list[bytes] = []
            first = True
            for key in sorted([*head, "groups"]):
                lead = "{" if first else ","
                first = False
                if key != "groups":
                    value = json.dumps(head[key], sort_keys=True, separators=_SEPARATORS)
                    out.append(deflate.compress(f"{lead}{json.dumps(key)}:{value}".encode()))
                    continue
                out.append(deflate.compress(f"{lead}{json.dumps(key)}:[".encode()))
                for i in range(0, len(group_texts), _FINISH_CHUNK):
                    chunk = ",".join(group_texts[i : i + _FINISH_CHUNK])
                    out.append(deflate.compress((("," if i else "") + chunk).encode()))
                out.append(deflate.compress(b"]"))
            out.append(deflate.compress(b"}"))
            out.append(deflate.flush())
            return b"".join(out)

        return finish
