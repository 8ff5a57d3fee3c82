"""The state's groups and siblings are rows CPython's cyclic collector untracks on its own.

A group is stored as a plain tuple of atoms (``GroupRow``) holding a plain tuple of its
siblings' rows (``SiblingRow``), in a table (``GroupTable``) that makes a view
(``GroupState``) per read; CPython untracks such tuples at the first collections that see
them, so the state's groups cost a full collection nothing per group, not one object per
group (or per sibling). These tests hold what that rests on: the rows' types are atoms the
collector never tracks (an enum member it does, hence the phase and the status as
strings), every kind of change replaces a row by a new plain tuple, views read and write
the table's rows, and nothing here reaches into CPython's internals.
"""

from __future__ import annotations

import copy
import gc
import pickle
import platform
import types
import typing

import pytest
from domain_helpers import (
    PureRun,
    abort,
    admit_all,
    assert_rows_untracked,
    complete,
    dispatch,
    fail,
    finish_step,
    group,
    step_groups,
)

from rolloutlog.controller.domain import RecordTrainStep, Restore, Resume, RunState, SelectBatch
from rolloutlog.controller.domain.state import (
    GROUP_FIELDS,
    NEW_SIBLING_ROW,
    GroupRow,
    GroupState,
    GroupTable,
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


def test_a_group_row_holds_atoms_and_a_tuple_of_rows() -> None:
    hints = typing.get_args(GroupRow)
    assert len(hints) == len(GROUP_FIELDS)
    for name, hint in zip(GROUP_FIELDS, hints, strict=True):
        if name == "sibling_rows":
            assert hint == tuple[SiblingRow, ...]
            continue
        kinds = _kinds(hint)
        assert kinds <= _UNTRACKED_ATOMS, f"GroupRow's {name} may hold {kinds - _UNTRACKED_ATOMS}"
    assert gc.is_tracked(Phase.READY)  # why the row stores the phase's string
    # A view holds no field of its own but the id: every other field reads the row.
    assert set(GroupState.__slots__) == {"group_id", "_rows", "_row"}
    for name in GROUP_FIELDS[1:]:
        assert isinstance(getattr(GroupState, name), property), name


def test_the_table_holds_plain_tuples_and_no_view() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    table = run.state.groups
    assert isinstance(table, GroupTable)
    for gid, row in table._rows.items():
        assert type(row) is tuple and row[0] == gid
        assert type(row[4]) is tuple and all(type(r) is tuple for r in row[4])
        assert table.row(gid) is row
    assert not any(isinstance(o, GroupState) for o in gc.get_referents(table._rows))


def test_rows_made_by_each_kind_of_sibling_change_are_untracked() -> None:
    run = PureRun(group_size=3, groups_per_step=2, lookahead=2, attempts_per_sibling=3)
    admit_all(run)
    assert_rows_untracked(run.state)  # admission
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    assert_rows_untracked(run.state)
    complete(run, gid, 0)
    assert_rows_untracked(run.state)
    fail(run, gid, 1, retryable=True)
    assert_rows_untracked(run.state)
    abort(run, gid, 2)
    assert_rows_untracked(run.state)
    statuses = [s.status for s in group(run, gid).siblings]
    assert statuses == [SiblingStatus.DONE, SiblingStatus.PENDING, SiblingStatus.PENDING]
    assert group(run, gid).sibling(1).failures == 1


def test_rows_made_by_each_kind_of_group_change_are_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2, sampler="windowed")
    admit_all(run)
    step0 = step_groups(run, 0)
    finish_step(run, 0)  # committed: ready, with its ready order
    assert step0 and all(group(run, gid).phase is Phase.READY for gid in step0)
    assert_rows_untracked(run.state)
    run.execute(SelectBatch(0))  # selected, with its step and staleness
    trained = list(run.state.batches[0])
    assert trained and all(group(run, gid).selected_for == 0 for gid in trained)
    assert_rows_untracked(run.state)
    run.execute(RecordTrainStep(0, 1))  # the trained groups leave the table
    assert not any(gid in run.state.groups for gid in trained)
    assert_rows_untracked(run.state)
    run.execute(Restore(run.state.last_seq, epoch=2, mode="salvage", forced=True))
    assert all(g.recovered for g in run.state.groups.values() if g.phase is not Phase.SPARE)
    assert_rows_untracked(run.state)


def test_a_view_reads_and_writes_the_tables_row() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    admit_all(run)
    table = run.state.groups
    gid = next(iter(table))
    a, b = table[gid], table.get(gid)
    assert a is not b and a == b
    b.ready_order = 41  # a change through one view is the table's, so every view's
    assert a.ready_order == 41 and table.row(gid)[GROUP_FIELDS.index("ready_order")] == 41
    a.phase = Phase.READY
    assert b.phase is Phase.READY and table.row(gid)[GROUP_FIELDS.index("phase")] == "ready"
    with pytest.raises(ValueError, match="'gone' is not a valid Phase"):
        a.phase = "gone"  # type: ignore[assignment]
    assert [g.group_id for g in table.values()] == list(table) == [k for k, _ in table.items()]
    # A view of a group that left reads it as it left; changing it changes no table.
    popped = table.pop(gid)
    assert gid not in table and a.ready_order == 41 and popped == a
    a.ready_order = 7
    assert gid not in table and popped.ready_order == 41
    # A new group's view reads the table once it is put there.
    made = GroupState(gid, 0, None, Phase.SPARE, (NEW_SIBLING_ROW,) * 2)
    table[gid] = made
    table[gid].data_pass = 3
    assert made.data_pass == 3
    with pytest.raises(ValueError, match="group 5 stored under id 6"):
        table[6] = GroupState(5, 0, None, Phase.SPARE, ())
    with pytest.raises(TypeError, match="not dict"):
        table[6] = {}  # type: ignore[assignment]
    assert RunState(groups={gid: made}).groups == GroupTable({gid: made})


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
    assert_rows_untracked(run.state)


def test_a_restore_leaves_every_row_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    for gid in list(run.state.groups)[:2]:
        dispatch(run, gid)
    run.execute(Restore(run.state.last_seq, epoch=2, mode="salvage", forced=True))
    assert_rows_untracked(run.state)


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
        assert_rows_untracked(state)


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
    assert_rows_untracked(RunState(groups={7: made}))
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


def test_tracked_objects_do_not_grow_with_the_groups() -> None:
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
    # No object per group whatever its size (a group of 16 was 18 before sibling rows, 1
    # before group rows): what the run itself holds (config, counters, the table).
    assert one < 200 and sixteen < 200, (one, sixteen)


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
