"""Passes over a dataset: the pure functions live in the domain
(:mod:`rolloutlog.controller.domain.passes`), which replays them; re-exported here for
the workloads that walk a dataset."""

from __future__ import annotations

from rolloutlog.controller.domain.passes import (
    PromptKey,
    cursor_of,
    pass_permutation,
    pass_seed,
    prompt_at,
)

__all__ = ["PromptKey", "cursor_of", "pass_permutation", "pass_seed", "prompt_at"]
