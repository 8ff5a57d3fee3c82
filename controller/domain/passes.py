"""Passes over a dataset: a prompt's identity is ``(pass, index)``, each pass shuffled.

Pure functions only (no clock, no global random state, no I/O), so the domain can call
them from ``decide``/``evolve`` and a replay recomputes the same order: the order of
pass ``p`` is :func:`pass_permutation` ``(seed, p, size)``, a function of its arguments
alone. The seed is what the log records (once per run, or per pass).

Phase A uses only single-pass runs; the dispatch cursor of phase B walks
``PromptKey``s with :func:`prompt_at` / :func:`cursor_of`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class PromptKey:
    """The identity of one use of a prompt: dataset ``index`` in pass ``pass_``."""

    pass_: int
    index: int


def pass_seed(seed: int, pass_: int) -> int:
    """The shuffle seed of pass ``pass_`` derived from the run's ``seed`` (stable across
    Python versions and processes: a hash, not ``hash()``)."""
    if seed < 0 or pass_ < 0:
        raise ValueError(f"seed {seed} and pass {pass_} must be >= 0")
    text = f"rolloutlog-pass:{seed}:{pass_}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def pass_permutation(seed: int, pass_: int, size: int, *, shuffle: bool = True) -> list[int]:
    """Dataset indices in the order pass ``pass_`` visits them (a permutation of
    ``range(size)``; the identity when ``shuffle`` is false)."""
    if size < 0:
        raise ValueError(f"dataset size {size} must be >= 0")
    order = list(range(size))
    if shuffle:
        random.Random(pass_seed(seed, pass_)).shuffle(order)
    return order


def prompt_at(
    seed: int, cursor: int, size: int, *, shuffle: bool = True, passes: int | None = None
) -> PromptKey:
    """The prompt at dispatch position ``cursor`` of a walk over ``passes`` passes
    (unbounded when ``None``): pass ``cursor // size``, the ``cursor % size``-th entry of
    that pass's permutation. Raises :class:`IndexError` past the last pass."""
    if size <= 0:
        raise ValueError("cannot walk an empty dataset")
    if cursor < 0:
        raise IndexError(f"cursor {cursor} < 0")
    pass_, pos = divmod(cursor, size)
    if passes is not None and pass_ >= passes:
        raise IndexError(f"cursor {cursor} is past the last of {passes} passes of {size} prompts")
    return PromptKey(pass_, pass_permutation(seed, pass_, size, shuffle=shuffle)[pos])


def cursor_of(seed: int, key: PromptKey, size: int, *, shuffle: bool = True) -> int:
    """The dispatch position of ``key`` (inverse of :func:`prompt_at`)."""
    order = pass_permutation(seed, key.pass_, size, shuffle=shuffle)
    return key.pass_ * size + order.index(key.index)


__all__ = ["PromptKey", "cursor_of", "pass_permutation", "pass_seed", "prompt_at"]
