"""Groups and siblings stay out of CPython's cyclic collector (controller/domain/untracked.py).

The untracking is only sound while these objects cannot be part of a reference cycle, so
the field types are pinned here: a new field that can hold a container fails the test
and has to be argued for.
"""

from __future__ import annotations

import gc
import platform
import tracemalloc
import types
import typing
from dataclasses import fields

import pytest
from domain_helpers import PureRun, admit_all, assert_state_untracked, complete, dispatch, group

from rolloutlog.controller.domain import AdmitStep, Resume, RunState
from rolloutlog.controller.domain.state import GroupState, Phase, SiblingState, SiblingStatus
from rolloutlog.controller.domain.untracked import untrack
from rolloutlog.controller.snapshot_encoder import SnapshotEncoder, encode_snapshot

pytestmark = pytest.mark.skipif(
    platform.python_implementation() != "CPython", reason="untracking is CPython's"
)

_ATOMS = {int, float, str, bool, type(None), Phase, SiblingStatus}


def _field_types(cls: type) -> dict[str, set[object]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[f.name] = set(args)
    return out


def test_a_sibling_holds_only_atoms() -> None:
    for name, kinds in _field_types(SiblingState).items():
        assert kinds <= _ATOMS, f"SiblingState.{name} may hold {kinds - _ATOMS}"


def test_a_group_holds_only_atoms_and_its_sibling_list() -> None:
    kinds = _field_types(GroupState)
    assert kinds.pop("siblings") == {list[SiblingState]}
    for name, found in kinds.items():
        assert found <= _ATOMS, f"GroupState.{name} may hold {found - _ATOMS}"


def test_groups_made_by_admission_dispatch_and_completion_are_untracked() -> None:
    run = PureRun(group_size=3, groups_per_step=2, lookahead=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    complete(run, gid, 0)
    assert run.state.groups
    assert_state_untracked(run.state)
    assert not any(g is run.state.groups[gid] for g in gc.get_objects())


def test_siblings_reset_by_a_new_epoch_are_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    admit_all(run)
    gid = next(iter(run.state.groups))
    dispatch(run, gid)
    before = group(run, gid).siblings[0]
    run.execute(Resume(epoch=2))  # in-flight siblings are replaced by fresh ones
    assert group(run, gid).siblings[0] is not before
    assert_state_untracked(run.state)


def test_a_state_decoded_from_a_snapshot_is_untracked_and_equal() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    decoded = RunState.from_snapshot(run.state.to_snapshot())
    assert decoded.groups and decoded.to_snapshot() == run.state.to_snapshot()
    assert_state_untracked(decoded)


def test_a_deep_copy_is_tracked_as_usual_and_equal() -> None:
    run = PureRun(group_size=2, groups_per_step=2)
    run.execute(AdmitStep())
    copied = run.state.copy()
    assert copied.to_snapshot() == run.state.to_snapshot()
    g = next(iter(copied.groups.values()))
    assert gc.is_tracked(g)  # built without __init__: only walked, still correct


def test_untracked_groups_are_freed_by_reference_counting() -> None:
    def build() -> dict[int, GroupState]:
        def siblings(i: int) -> list[SiblingState]:
            done = SiblingStatus.DONE
            return [SiblingState(1, done, 0, 0, 9, 0.5, f"p{i}-{k}") for k in range(4)]

        return {i: GroupState(i, i, 0, Phase.READY, siblings(i)) for i in range(20_000)}

    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        groups = build()
        held, _ = tracemalloc.get_traced_memory()
        del groups
        after, _ = tracemalloc.get_traced_memory()  # no collection: refcounts alone
    finally:
        tracemalloc.stop()
    assert held - base > 5_000_000, "the state was not built"
    assert after - base < (held - base) / 50, f"{after - base} bytes still held of {held - base}"


def test_untrack_is_idempotent_and_safe_on_untracked_objects() -> None:
    s = SiblingState()
    assert not gc.is_tracked(s)
    untrack(s)
    untrack(42)  # not a container at all
    s.status = SiblingStatus.DONE  # still an ordinary object
    assert s.status is SiblingStatus.DONE


def test_the_snapshot_encoders_per_group_containers_are_untracked() -> None:
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2)
    admit_all(run)
    encoder = SnapshotEncoder()
    assert not gc.is_tracked(encoder._dirty)
    assert encoder.refresh(run.state, None)
    assert not gc.is_tracked(encoder._dirty)  # replaced by every group's id, still untracked
    seen: list[object] = []
    finish = encoder.cut(run.state)
    # The cut's list of group texts is held by ``finish``; find it among its cells.
    for cell in finish.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            seen.append(value)
    assert seen and not any(gc.is_tracked(v) for v in seen)
    assert finish() == encode_snapshot(run.state)


def test_a_group_added_to_the_state_leaves_the_groups_dict_untracked() -> None:
    state = RunState()
    assert not gc.is_tracked(state.groups)
    state.add_group(GroupState(7, 7, None, Phase.SPARE, [SiblingState()]))
    assert 7 in state.groups and not gc.is_tracked(state.groups)
    state.groups[8] = GroupState(8, 8, None, Phase.SPARE, [SiblingState()])
    assert gc.is_tracked(state.groups)  # CPython re-tracks a dict given a container
