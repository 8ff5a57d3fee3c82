"""Spares left at the end of the data fill the last step (issue 31, item 6).

The spare pool is pulled from the dataset walk ahead of the steps, so at the walk's end
the prompts it holds would never be trained: the last step, which the data alone cannot
fill, takes them (``SpareAssigned`` with neither a replaced group nor a loan).
"""

from __future__ import annotations

import math

from domain_helpers import PureRun, admit, finish_step, kinds, only, train
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.controller.domain import AdmitStep, find_violations
from rolloutlog.controller.domain.errors import DatasetExhaustedError, LookaheadExceededError


def test_the_last_step_takes_the_spares_the_data_cannot_replace() -> None:
    # 9 prompts, 3 a step, 2 spares pulled ahead at step 0: step 2 gets 1 prompt + 2 spares.
    run = PureRun(groups_per_step=3, spare_pool_size=2, lookahead=5, dataset_size=9)
    admit(run)
    admit(run)
    assert run.state.spares == [3, 4]
    last = admit(run)
    assert kinds(last) == ["StepAdmitted", "GroupAdmitted", "SpareAssigned", "SpareAssigned"]
    (step,) = only(last, "StepAdmitted")
    assert (step.target_step, step.group_count) == (2, 3)
    filled = only(last, "SpareAssigned")
    assert [(e.group_id, e.prompt_index, e.target_step) for e in filled] == [(3, 3, 2), (4, 4, 2)]
    assert all(e.replaces_group_id is None and e.repays_group_id is None for e in filled)
    assert run.state.spares == [] and run.state.quotas[2] == 3
    for t in range(3):
        finish_step(run, t)
        applied = train(run)
    (batch,) = only(applied, "BatchSelected")
    assert (sorted(batch.group_ids), batch.shortfall) == ([3, 4, 8], 0)
    c = run.state.counters
    assert (c.groups_trained, c.shortfall, c.replacements) == (9, 0, 0)
    assert list(find_violations(run.state)) == []


def test_a_full_last_step_leaves_the_spares_alone() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=1, lookahead=5, dataset_size=5)
    admit(run)  # prompts 0, 1 and spare 2
    last = admit(run)  # prompts 3, 4: the data fills the step
    assert kinds(last) == ["StepAdmitted", "GroupAdmitted", "GroupAdmitted"]
    assert run.state.spares == [2]


@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 25),
    passes=st.integers(1, 3),
    groups_per_step=st.integers(1, 6),
    spare_pool_size=st.integers(0, 4),
)
def test_without_drops_every_pulled_prompt_is_trained(
    dataset_size: int, passes: int, groups_per_step: int, spare_pool_size: int
) -> None:
    """With nothing dropped, every prompt of every pass is trained once, and only the
    last step may be short: by what the whole walk lacks of a full step."""
    run = PureRun(
        groups_per_step=groups_per_step,
        spare_pool_size=spare_pool_size,
        lookahead=1,
        dataset_size=dataset_size,
        passes=passes,
        shuffle_seed=3,
    )
    walk = dataset_size * passes
    while True:
        try:
            run.execute(AdmitStep())
        except DatasetExhaustedError:
            if run.state.train_step == run.state.dispatch_cursor:
                break
        except LookaheadExceededError:
            pass
        step = run.state.train_step
        finish_step(run, step)
        train(run)
        assert list(find_violations(run.state)) == []
    steps = math.ceil(walk / groups_per_step)
    c = run.state.counters
    assert run.state.train_step == steps
    assert run.state.spares == []
    assert (c.groups_trained, c.shortfall) == (walk, steps * groups_per_step - walk)
    shortfalls = [ev.shortfall for _, ev in run.log if ev.event_type == "BatchSelected"]
    assert all(s == 0 for s in shortfalls[:-1]), shortfalls
