"""A group's siblings are rows CPython's cyclic collector untracks on its own.

A sibling is stored as a plain tuple of atoms (``SiblingRow``) in a plain tuple per group;
CPython untracks such tuples at the first collection that sees them, so the state costs a
full collection one object per group, not one per sibling. These tests hold what that
rests on: the row's types are atoms the collector never tracks (an enum member it does,
hence the status as a string), every kind of change replaces a row by a new plain tuple,
and nothing here reaches into CPython's internals.
"""

from __future__ import annotations

import copy
import gc
import pickle
import platform
import types
import typing
from dataclasses import fields

import pytest
from domain_helpers import (
    PureRun,
    abort,
    admit_all,
    assert_siblings_untracked,
    complete,
    dispatch,
    fail,
    group,
)

from rolloutlog.controller.domain import Restore, Resume, RunState
from rolloutlog.controller.domain.state import (
    NEW_SIBLING_ROW,
    GroupState,
    Phase,
    SiblingRow,
    SiblingState,
    SiblingStatus,
)
from rolloutlog.controller.snapshot_encoder import SnapshotEncoder, encode_snapshot

pytestmark = pytest.mark.skipif(
    platform.python_implementation() != "CPython", reason="the collector's tracking is CPython's"
)

#: Values CPython's collector never tracks (not containers at all).
_UNTRACKED_ATOMS = {int, float, str, bool, type(None)}


def _kinds(hint: object) -> set[object]:
    return set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}


def _rows(state: RunState) -> list[SiblingRow]:
    return [row for g in state.groups.values() for row in g.sibling_rows]


def test_a_sibling_row_holds_only_atoms_the_collector_never_tracks() -> None:
    for i, hint in enumerate(typing.get_args(SiblingRow)):
        kinds = _kinds(hint)
        assert kinds <= _UNTRACKED_ATOMS, f"SiblingRow[{i}] may hold {kinds - _UNTRACKED_ATOMS}"
    assert len(typing.get_args(SiblingRow)) == len(SiblingState._fields)
    assert gc.is_tracked(SiblingStatus.DONE)  # why the row stores the status's string


def test_a_group_holds_atoms_and_a_tuple_of_rows() -> None:
    hints = typing.get_type_hints(GroupState)
    for f in fields(GroupState):
        if f.name == "sibling_rows":
            assert hints[f.name] == tuple[SiblingRow, ...]
            continue
        kinds = _kinds(hints[f.name])
        assert kinds <= _UNTRACKED_ATOMS | {Phase}, f"GroupState.{f.name} may hold {kinds}"


def test_rows_made_by_each_kind_of_sibling_change_are_untracked() -> None:
    run = PureRun(group_size=3, groups_per_step=2, lookahead=2, attempts_per_sibling=3)
    admit_all(run)
    assert_siblings_untracked(run.state)  # admission
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    assert_siblings_untracked(run.state)
    complete(run, gid, 0)
    assert_siblings_untracked(run.state)
    fail(run, gid, 1, retryable=True)
    assert_siblings_untracked(run.state)
    abort(run, gid, 2)
    assert_siblings_untracked(run.state)
    statuses = [s.status for s in group(run, gid).siblings]
    assert statuses == [SiblingStatus.DONE, SiblingStatus.PENDING, SiblingStatus.PENDING]
    assert group(run, gid).sibling(1).failures == 1


def test_a_new_epoch_replaces_in_flight_rows_by_untracked_ones() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    before = group(run, gid).sibling_rows[0]
    run.execute(Resume(epoch=2))  # in-flight siblings are reset to pending
    after = group(run, gid).sibling_rows[0]
    assert after is not before and before[1] == "in_flight"  # the old row is unchanged
    assert after == (1, "pending", None, 0, 0, None, None, False)
    assert_siblings_untracked(run.state)


def test_a_restore_leaves_every_row_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    for gid in list(run.state.groups)[:2]:
        dispatch(run, gid)
    run.execute(Restore(run.state.last_seq, epoch=2, mode="salvage", forced=True))
    assert_siblings_untracked(run.state)


def test_copies_of_a_state_have_untracked_rows_and_are_equal() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    complete(run, gid, 1)
    copies = {
        "snapshot": RunState.from_snapshot(run.state.to_snapshot()),
        "deepcopy": run.state.copy(),
        "pickle": pickle.loads(pickle.dumps(run.state)),
        "copy": copy.copy(run.state),
    }
    for how, state in copies.items():
        assert state == run.state, how
        assert state.to_snapshot() == run.state.to_snapshot(), how
        assert_siblings_untracked(state)


def test_a_sibling_is_read_as_a_view_with_enum_status() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid, (1,))
    g = group(run, gid)
    assert g.siblings == (SiblingState(), SiblingState(1, SiblingStatus.IN_FLIGHT, 0))
    assert g.sibling(1).status is SiblingStatus.IN_FLIGHT
    assert g.sibling_rows[0] is NEW_SIBLING_ROW  # unchanged rows are shared, not copied
    with pytest.raises(AttributeError):
        g.siblings[1].status = SiblingStatus.DONE  # type: ignore[misc]
    made = GroupState.new(7, 7, None, Phase.SPARE, [SiblingState(), g.sibling(1)], data_pass=1)
    assert made.sibling_rows == (NEW_SIBLING_ROW, g.sibling_rows[1]) and made.data_pass == 1
    assert_siblings_untracked(RunState(groups={7: made}))
    with pytest.raises(ValueError, match="'lost' is not a valid SiblingStatus"):
        SiblingState(status="lost").row()  # type: ignore[arg-type]


def test_a_snapshot_keeps_the_format_of_sibling_dicts() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid, (0,))
    complete(run, gid, 0, tokens=7, reward=0.25)
    saved = next(g for g in run.state.to_snapshot()["groups"] if g["group_id"] == gid)
    assert "sibling_rows" not in saved
    assert saved["siblings"][0] == {
        "attempt": 1,
        "status": "done",
        "weight_version": 0,
        "failures": 0,
        "completion_tokens": 7,
        "reward": 0.25,
        "payload_id": f"g{gid}-s0-a1",
        "salvaged": False,
    }
    assert saved["siblings"][1]["status"] == "pending"


def test_tracked_objects_do_not_grow_with_the_siblings_per_group() -> None:
    def tracked_after_admitting(group_size: int) -> int:
        gc.collect()
        before = len(gc.get_objects())
        run = PureRun(
            dataset_size=1000,
            group_size=group_size,
            groups_per_step=100,
            lookahead=4,
            spare_pool_size=0,
        )
        run.log.clear()  # the events are the test's, not the state's
        admit_all(run)
        run.log.clear()
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert len(run.state.groups) == 500  # lookahead 4: steps 0-4
        return grown

    one, sixteen = tracked_after_admitting(1), tracked_after_admitting(16)
    # One object per group whatever its size (a group of 16 was 18 before rows).
    assert sixteen < one + 200, (one, sixteen)
    assert sixteen < 2 * 500 + 200, sixteen


def test_the_snapshot_encoders_per_group_containers_are_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    encoder = SnapshotEncoder()
    assert not gc.is_tracked(encoder._dirty)
    assert encoder.refresh(run.state, None)
    assert not gc.is_tracked(encoder._dirty)  # replaced by every group's id
    encoder.touched(e for _, e in dispatch(run, next(iter(run.state.groups))))
    assert encoder._dirty and not gc.is_tracked(encoder._dirty)
    assert encoder.refresh(run.state, None)
    finish = encoder.cut(run.state)
    gc.collect(0)
    # The cut's group texts are held by ``finish``; find them among its cells.
    seen = [
        cell.cell_contents
        for cell in finish.__closure__ or ()
        if isinstance(cell.cell_contents, tuple)
        and len(cell.cell_contents) == len(run.state.groups)
    ]
    assert seen and not any(gc.is_tracked(v) for v in seen)
    assert finish() == encode_snapshot(run.state)
