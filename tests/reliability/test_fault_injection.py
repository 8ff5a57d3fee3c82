"""Property: store write failures and crashes at random points never cost the guarantee.

Hypothesis draws a crash point (the log truncated to a commit boundary of a clean run,
as a kill between two transactions leaves it) and a sequence of write failures (the
store's ``append`` raises at a drawn call, in whichever command is being committed).
After each fault the log opens, a restore from the newest checkpoint of the current
history succeeds, and the run goes on; at the end every prompt is trained exactly once
or dropped/evicted with a recorded reason (counted from the log), and every invariant
holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_harness import (
    WEIGHTS,
    Prompts,
    backend,
    copy_prefix,
    exactly_once,
    start,
)

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController, iter_history
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import MemoryEventStore, StoreError

STEPS = 8
RUN = "r"
#: No commit window: every command tends to commit alone, so failures land anywhere.
STORE = StoreConfig(group_commit_window_ms=0, snapshot_interval=25)


class FlakyStore:
    """A store whose ``append`` raises at chosen calls; it records commit boundaries."""

    def __init__(self, inner: MemoryEventStore) -> None:
        self.inner = inner
        self.calls = 0
        self.fail_at: int | None = None
        self.boundaries: list[int] = []

    def arm(self, after: int | None) -> None:
        """Fail the ``after``-th append from now (None: never)."""
        self.fail_at = None if after is None else self.calls + after

    def append(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise StoreError(f"injected write failure at append #{self.calls}")
        last: int = self.inner.append(*args, **kwargs)
        self.boundaries.append(last)
        return last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _drive(ctl: RolloutController) -> None:
    """Train to STEPS (checkpoint after every step); every wait has a deadline."""
    runtime = RolloutRuntime(ctl, backend(), Prompts(), GenerationConfig(max_tokens=4))
    try:
        await runtime.start()
        await runtime.sync_weights(WEIGHTS, ctl.state.weight_version)
        while ctl.state.train_step < STEPS:
            step = ctl.state.train_step
            await runtime.next_batch(step, timeout=10)
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
            await runtime.checkpoint(step + 1)
    finally:
        with contextlib.suppress(Exception):  # a failed runtime may fail to close too
            await runtime.close()


def _newest_checkpoint(store: Any) -> int:
    """Offset of the newest CheckpointMarked of the current history."""
    marks = [row.seq for row, ev in iter_history(store, RUN) if ev.event_type == "CheckpointMarked"]
    assert marks, "the log holds no checkpoint to restore to"
    return marks[-1]


def _clean_base() -> tuple[MemoryEventStore, list[int]]:
    inner = MemoryEventStore()
    flaky = FlakyStore(inner)
    ctl = start(flaky, RUN)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(_drive(ctl), 120))
    ctl.close()
    return inner, flaky.boundaries


_BASE: tuple[MemoryEventStore, list[int]] | None = None


def _base() -> tuple[MemoryEventStore, list[int]]:
    global _BASE
    if _BASE is None:
        _BASE = _clean_base()
    return _BASE


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    crash=st.floats(0, 1),
    failures=st.lists(st.integers(1, 80), min_size=1, max_size=3),
)
def test_write_failures_and_crashes_lose_nothing(crash: float, failures: list[int]) -> None:
    base, boundaries = _base()
    # The crash: the log a kill between two commits of the clean run leaves (it always
    # holds the first checkpoint, committed by start()).
    usable = [b for b in boundaries if b >= _newest_checkpoint_at_start(base)]
    k = usable[min(int(crash * len(usable)), len(usable) - 1)]
    inner = copy_prefix(base, RUN, k)
    store = FlakyStore(inner)
    for fail_after in [*failures, None]:
        # The log opens (a takeover) and restores from the newest checkpoint.
        RolloutController.open(store, RUN, store_config=STORE).close()  # type: ignore[arg-type]
        ctl, _report = RolloutController.restore(
            store,  # type: ignore[arg-type]
            RUN,
            _newest_checkpoint(inner),
            store_config=STORE,
        )
        store.arm(fail_after)
        try:
            asyncio.run(asyncio.wait_for(_drive(ctl), 60))
            failed = False
        except (StoreError, RuntimeError, TimeoutError):
            failed = True  # the injected failure stopped the run
        with contextlib.suppress(StoreError):
            ctl.close()
        if not failed:
            break
        assert fail_after is not None, "the run stopped without an injected failure"
        store.arm(None)
    result = exactly_once(inner, RUN)
    assert result["lost"] == () and result["trained_twice"] == (), result
    assert result["violations"] == []
    ctl = RolloutController.open(inner, RUN)
    assert ctl.state.train_step >= STEPS or ctl.state.dataset_cursor == inner_dataset_size()
    ctl.close()


def _newest_checkpoint_at_start(base: MemoryEventStore) -> int:
    """Offset of the first checkpoint (start() marks one at train step 0)."""
    return next(row.seq for row in base.read(RUN) if row.type == "CheckpointMarked")


def inner_dataset_size() -> int:
    """Prompts in the harness's dataset."""
    return Prompts.num_prompts
