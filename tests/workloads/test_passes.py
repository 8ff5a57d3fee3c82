"""Passes over a dataset: per-pass permutations are pure functions of (seed, pass)."""

from __future__ import annotations

import pytest

from rolloutlog.controller.workloads.passes import (
    PromptKey,
    cursor_of,
    pass_permutation,
    pass_seed,
    prompt_at,
)


def test_each_pass_is_a_permutation_fixed_by_seed_and_pass() -> None:
    a0 = pass_permutation(7, 0, 24)
    assert sorted(a0) == list(range(24))
    assert pass_permutation(7, 0, 24) == a0  # pure: same arguments, same order
    assert pass_permutation(7, 1, 24) != a0  # another pass, another order
    assert pass_permutation(8, 0, 24) != a0  # another seed, another order
    assert pass_permutation(7, 3, 24, shuffle=False) == list(range(24))
    assert pass_seed(7, 1) == pass_seed(7, 1) != pass_seed(7, 2)


def test_walk_visits_every_prompt_once_per_pass() -> None:
    keys = [prompt_at(5, c, 10, passes=2) for c in range(20)]
    assert sorted(keys) == [PromptKey(p, i) for p in range(2) for i in range(10)]
    assert [cursor_of(5, k, 10) for k in keys] == list(range(20))
    with pytest.raises(IndexError, match="past the last of 2 passes"):
        prompt_at(5, 20, 10, passes=2)
