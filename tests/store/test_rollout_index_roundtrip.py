"""The rollout index gives every event back its keys, whichever table holds them.

Random runs of keyed events (sibling events, whose keys go to ``rollout_sibling_index``
and ``rollout_step_marks``; other events, to ``rollout_index``; events without keys),
with train steps and weight versions that change at random, appended in random batch
sizes: ``read_indexed``, ``read_where`` (by group, step, type, prompt) and, on SQL, the
``history_events`` view return exactly the keys each event was appended with, on every
backend.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutlog.controller.rollout_index import (
    SIBLING_TYPES,
    attach,
    read_indexed,
    read_where,
)
from rolloutlog.eventstore import EventStore, NewEvent

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
OTHER_TYPES = ("GroupAdmitted", "GroupCommitted", "StepTrained", "Foreign")
_RUNS = itertools.count()


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[NewEvent], list[int]]:
    """Events with their keys (as the controller's ``encode`` builds them) and the batch
    sizes they are appended in."""
    n = draw(st.integers(1, 60))
    step = draw(st.integers(0, 3))
    version = step
    events = []
    for i in range(n):
        if draw(st.integers(0, 9)) == 0:  # the trainer moves on now and then
            step += 1
            version = draw(st.sampled_from([step, step + 1]))
        kind = draw(st.sampled_from(["sibling", "sibling", "sibling", "other", "bare"]))
        if kind == "sibling":
            typ = draw(st.sampled_from(sorted(SIBLING_TYPES)))
            derived: tuple[Any, ...] | None = (draw(st.integers(0, 5)), None, None, step, version)
        elif kind == "other":
            typ = draw(st.sampled_from(OTHER_TYPES[:3]))
            derived = (
                draw(st.none() | st.integers(0, 5)),
                draw(st.none() | st.integers(0, 9)),
                draw(st.none() | st.integers(0, 3)),
                step,
                version,
            )
        else:  # not written by the controller: no keys at all
            typ, derived = "Foreign", None
        events.append(NewEvent(typ, 1, f'{{"i": {i}}}', NOW, derived))
    sizes = []
    left = n
    while left:
        size = draw(st.integers(1, left))
        sizes.append(size)
        left -= size
    return events, sizes


def _keys(ev: NewEvent) -> tuple[Any, ...]:
    """(train_step, weight_version, group_id, prompt_index, target_step) of an event."""
    if ev.derived is None:
        return (None,) * 5
    gid, pidx, tstep, step, wv = ev.derived
    return (step, wv, gid, pidx, tstep)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=runs())
def test_every_event_gets_its_keys_back(store, case) -> None:  # store: conftest's
    events, sizes = case
    run = f"r{next(_RUNS)}"
    attach(store)
    store.create_run(run)
    seq = 1
    for size in sizes:
        store.append(run, events[seq - 1 : seq - 1 + size], expected_seq=seq, epoch=1)
        seq += size
    expected = {i: _keys(ev) for i, ev in enumerate(events, 1)}

    got = {r.seq: (r.train_step, r.weight_version, r.group_id, r.prompt_index, r.target_step)
           for r in read_indexed(store, run)}  # fmt: skip
    assert got == expected
    # A chunk starting mid-run still finds the marks after it.
    tail = list(read_indexed(store, run, from_seq=max(1, len(events) // 2)))
    assert [(r.seq, r.train_step, r.weight_version) for r in tail] == [
        (s, expected[s][0], expected[s][1]) for s in range(max(1, len(events) // 2), seq)
    ]

    def lookup(**kw: Any) -> list[tuple[int, tuple[Any, ...]]]:
        return [
            (r.seq, (r.train_step, r.weight_version, r.group_id, r.prompt_index, r.target_step))
            for r in read_where(store, run, **kw)
        ]

    def naive(pred: Any) -> list[tuple[int, tuple[Any, ...]]]:
        return [(s, k) for s, k in sorted(expected.items()) if events[s - 1].derived and pred(s)]

    for gid in range(6):
        assert lookup(group_id=gid) == naive(lambda s, g=gid: expected[s][2] == g)
    for step in {k[0] for k in expected.values() if k[0] is not None}:
        assert lookup(train_step=step) == naive(lambda s, t=step: expected[s][0] == t)
        assert lookup(group_id=1, train_step=step) == naive(
            lambda s, t=step: expected[s][0] == t and expected[s][2] == 1
        )
    for typ in ("SiblingCompleted", "GroupAdmitted"):
        assert lookup(event_type=typ) == naive(lambda s, t=typ: events[s - 1].type == t)
    assert lookup(prompt_index=3) == naive(lambda s: expected[s][3] == 3)

    if isinstance(store, EventStore):
        with store.engine.connect() as conn:
            viewed = conn.execute(
                sa.text(
                    "SELECT seq, train_step, weight_version, group_id, prompt_index, "
                    "target_step FROM history_events WHERE run_id = :r ORDER BY seq"
                ),
                {"r": run},
            ).all()
        assert {r[0]: tuple(r[1:]) for r in viewed} == expected
