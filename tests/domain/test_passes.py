"""Passes over the data in the pure core: the dataset cursor walks ``passes`` passes,
each in the order ``pass_permutation(shuffle_seed, pass, size)``; a prompt's identity is
``(pass, index)`` in events, state and the conservation invariant; logs and snapshots
written before passes existed decode as one unshuffled pass."""

from __future__ import annotations

import pytest
from domain_helpers import PureRun, admit_all

from rolloutlog.controller.domain import AdmitStep, evolve, find_violations
from rolloutlog.controller.domain.errors import (
    ConservationError,
    DatasetExhaustedError,
    UnknownReferenceError,
)
from rolloutlog.controller.domain.events import GroupAdmitted, RunStarted, SparePulled
from rolloutlog.controller.domain.state import RunState
from rolloutlog.controller.workloads.passes import pass_permutation


def _pulled(run: PureRun) -> list[tuple[int, int]]:
    return [
        (ev.data_pass, ev.prompt_index)
        for _, ev in run.log
        if isinstance(ev, GroupAdmitted | SparePulled)
    ]


def test_the_cursor_walks_every_pass_in_its_recorded_shuffled_order() -> None:
    run = PureRun(dataset_size=6, passes=3, shuffle_seed=11, lookahead=100, groups_per_step=4)
    admit_all(run)
    pulled = _pulled(run)
    orders = [[i for p, i in pulled if p == pass_] for pass_ in range(3)]
    assert orders == [pass_permutation(11, p, 6) for p in range(3)]
    assert len(set(map(tuple, orders))) > 1  # each pass has its own order
    assert run.state.dataset_cursor == 18 and not find_violations(run.state)
    with pytest.raises(DatasetExhaustedError, match="6 prompts x 3 pass"):
        run.execute(AdmitStep())


def test_without_a_seed_every_pass_is_in_dataset_order() -> None:
    run = PureRun(dataset_size=4, passes=2, lookahead=100, groups_per_step=3)
    admit_all(run)
    assert _pulled(run) == [(p, i) for p in range(2) for i in range(4)]


def test_a_prompt_must_be_pulled_in_its_own_pass() -> None:
    run = PureRun(dataset_size=2, passes=2, spare_pool_size=0, groups_per_step=2)
    run.execute(AdmitStep())  # pulls (0, 0), (0, 1): the cursor is at (1, 0)
    offset = run.state.last_seq + 1
    with pytest.raises(UnknownReferenceError, match=r"pulled out of order \(pass 0\)"):
        evolve(run.state.copy(), SparePulled(group_id=2, prompt_index=0, data_pass=0), offset)
    state = evolve(run.state.copy(), SparePulled(group_id=2, prompt_index=0, data_pass=1), offset)
    assert (state.groups[2].data_pass, state.groups[2].prompt_index) == (1, 0)


def test_the_same_index_in_two_passes_is_two_prompts_for_conservation() -> None:
    run = PureRun(dataset_size=2, passes=2, spare_pool_size=0, lookahead=5, groups_per_step=2)
    admit_all(run)
    state = run.state
    assert sorted((g.data_pass, g.prompt_index) for g in state.groups.values()) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert not find_violations(state)
    state.groups[3].data_pass = 0  # (0, 1) now in two groups
    assert any(
        isinstance(v, ConservationError) and "is in groups 1 and 3" in str(v)
        for v in find_violations(state)
    )


def test_old_logs_and_snapshots_decode_as_one_unshuffled_pass() -> None:
    started = RunStarted.model_validate(
        {
            "run_id": "r",
            "rollout": {},
            "config_fingerprint": "fp",
            "dataset_fingerprint": "ds",
            "dataset_size": 3,
        }
    )
    assert (started.passes, started.shuffle_seed) == (1, None)
    assert (
        GroupAdmitted.model_validate({"group_id": 0, "prompt_index": 2, "target_step": 0}).data_pass
        == 0
    )
    run = PureRun(dataset_size=5, passes=2, shuffle_seed=3)
    admit_all(run)
    snap = run.state.to_snapshot()
    assert RunState.from_snapshot(snap).to_snapshot() == snap
    old = {k: v for k, v in snap.items() if k not in ("passes", "shuffle_seed")}
    old["groups"] = [{k: v for k, v in g.items() if k != "data_pass"} for g in snap["groups"]]
    restored = RunState.from_snapshot(old)
    assert (restored.passes, restored.shuffle_seed) == (1, None)
    assert all(g.data_pass == 0 for g in restored.groups.values())
