"""Runtime rules: the output commit rule, snapshot failures never stop a run, a failed
store write does (with a clear error), and telemetry listeners cannot kill a run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime, RunStoppedError
from rolloutlog.eventstore import EventStore, StoreError

WEIGHTS = [("w", torch.zeros(1))]


class _Prompts:
    fingerprint = "runtime-rules"
    num_prompts = 400

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 13, 2]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(len(completion_token_ids) % 2)


def _start(store: Any, snapshot_interval: int = 0) -> RolloutController:
    return RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=4, lookahead=1, staleness_bound=1),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=snapshot_interval, group_commit_window_ms=50),
    )


async def _train(ctl: RolloutController, steps: int, check: Any = None) -> None:
    runtime = RolloutRuntime(
        ctl, DeterministicBackend(vocab_size=16), _Prompts(), GenerationConfig(max_tokens=3)
    )
    await runtime.start()
    try:
        for step in range(ctl.state.train_step, steps):
            batch = await runtime.next_batch(step)
            if check is not None:
                check(batch)
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
    finally:
        await runtime.close()


def test_a_batch_is_durable_before_the_trainer_sees_it(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    reader = EventStore.open(sqlite_url)
    ctl = _start(store)
    seen: list[int] = []

    def check(batch: Any) -> None:
        # A second connection already sees the batch's selection: it is durable.
        durable = {
            (r.type, r.train_step) for r in read_indexed(reader, "r") if r.type == "BatchSelected"
        }
        assert ("BatchSelected", batch.train_step) in durable
        seen.append(batch.train_step)

    asyncio.run(_train(ctl, 4, check))
    assert seen == [0, 1, 2, 3]
    ctl.close()
    store.close()
    reader.close()


class _SnapshotsFail:
    """A store whose snapshots always fail (everything else is the real store)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.attempts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def save_snapshot(self, *args: Any, **kwargs: Any) -> None:
        self.attempts += 1
        raise StoreError("disk full (injected)")


def test_snapshot_failures_never_stop_the_run(sqlite_url: str) -> None:
    store = _SnapshotsFail(EventStore.open(sqlite_url))
    ctl = _start(store, snapshot_interval=20)
    asyncio.run(_train(ctl, 5))
    ctl.close()
    assert store.attempts > 0
    assert ctl.snapshot_failures == store.attempts
    assert ctl.state.train_step == 5
    check_invariants(replay(store.store, "r").state)


class _WritesFail:
    """A store that accepts ``good`` appends and then fails every write."""

    def __init__(self, store: EventStore, good: int) -> None:
        self.store = store
        self.good = good

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, *args: Any, **kwargs: Any) -> int:
        if self.good <= 0:
            raise StoreError("could not write to the log: disk I/O error (injected)")
        self.good -= 1
        return self.store.append(*args, **kwargs)


def test_a_failed_store_write_stops_the_run_with_a_clear_error(sqlite_url: str) -> None:
    real = EventStore.open(sqlite_url)
    store = _WritesFail(real, good=3)
    ctl = _start(store)
    with pytest.raises((RunStoppedError, StoreError)) as info:
        asyncio.run(_train(ctl, 10))
    chain = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__
    assert any("disk I/O error (injected)" in m for m in chain), chain
    # What reached the log is a consistent prefix, and the run is restorable from it.
    state = replay(real, "r").state
    check_invariants(state)
    assert real.last_seq("r") >= 1


def test_a_failing_listener_does_not_kill_the_run(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    ctl = _start(store)
    calls = {"n": 0}

    def broken(_applied: object) -> None:
        calls["n"] += 1
        raise RuntimeError("telemetry bug (injected)")

    ctl.listeners.append(broken)
    asyncio.run(_train(ctl, 3))
    assert calls["n"] > 10
    assert ctl.state.train_step == 3
    ctl.close()
    store.close()
