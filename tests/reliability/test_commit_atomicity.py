"""One command is one transaction (issue 9, items 1 and 7).

A crash can only fall between two commits. With a small ``group_commit_max_batch`` the
commit boundaries used to fall inside multi-event commands (an ``AdmitStep``: one
``StepAdmitted`` plus its ``GroupAdmitted`` events), and a log cut there failed the
conservation invariant for good. Here every commit boundary of a real run is a crash
point: the log cut there must always open. And a run is created together with its first
event, so a crash while starting leaves no half-created run.
"""

from __future__ import annotations

from typing import Any

import pytest
from reliability_harness import (
    DATASET,
    FINGERPRINT,
    copy_prefix,
    drive,
    rollout_config,
    run,
)

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.domain.errors import RestoreError
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore, MemoryEventStore, RunExistsError, StoreError


class RecordingStore:
    """Delegates to a store; records the last offset of every committed append."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.commits: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def create_run(self, run_id: str, **kwargs: Any) -> Any:
        info = self.store.create_run(run_id, **kwargs)
        self.commits.append(info.last_seq)
        return info

    def append(self, run_id: str, batch: Any, **kwargs: Any) -> int:
        last = self.store.append(run_id, batch, **kwargs)
        if batch:
            self.commits.append(last)
        return last


def _recorded_run(max_batch: int) -> RecordingStore:
    store = RecordingStore(MemoryEventStore())
    ctl = RolloutController.start(
        store,  # type: ignore[arg-type]
        "r",
        rollout_config(),
        dataset_fingerprint=FINGERPRINT,
        dataset_size=DATASET,
        store_config=StoreConfig(
            snapshot_interval=0, group_commit_window_ms=5, group_commit_max_batch=max_batch
        ),
    )
    ctl.checkpoint(0)
    run(drive(ctl, 3))
    ctl.close()
    return store


def test_a_crash_after_any_commit_leaves_a_log_that_opens() -> None:
    store = _recorded_run(max_batch=3)
    types = [r.type for r in store.read("r")]
    assert types[0] == "RunStarted"
    # The run has commands larger than max_batch (a step admission with its groups).
    assert types.count("GroupAdmitted") > 3
    boundaries = sorted(set(store.commits))
    assert boundaries[-1] == store.last_seq("r")
    failures = []
    for k in boundaries:
        crashed = copy_prefix(store, "r", k)
        try:
            RolloutController.open(crashed, "r").close()
        except Exception as exc:  # collect them all: the message names the first
            failures.append((k, f"{type(exc).__name__}: {exc}"))
    assert failures == [], failures[:3]


def test_start_writes_the_run_and_its_first_event_in_one_commit(sqlite_url: str) -> None:
    store = RecordingStore(EventStore.open(sqlite_url))
    try:
        ctl = RolloutController.start(
            store,  # type: ignore[arg-type]
            "r",
            rollout_config(),
            dataset_fingerprint=FINGERPRINT,
            dataset_size=DATASET,
        )
        ctl.close()
        # One commit (create_run) holds the run's row and RunStarted: no append before it.
        assert store.commits[0] == 1
        assert [r.type for r in store.read("r")] == ["RunStarted"]
    finally:
        store.close()


class _CrashingCreate:
    """A store whose create_run dies before committing (the process crashed)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def create_run(self, run_id: str, **kwargs: Any) -> Any:
        raise StoreError("simulated crash while creating the run")


def test_a_crash_while_starting_leaves_no_half_created_run(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    try:
        with pytest.raises(StoreError, match="simulated crash"):
            RolloutController.start(
                _CrashingCreate(store),  # type: ignore[arg-type]
                "r",
                rollout_config(),
                dataset_fingerprint=FINGERPRINT,
                dataset_size=DATASET,
            )
        assert store.list_runs() == []
        # Starting again works: nothing says the run exists.
        ctl = RolloutController.start(
            store, "r", rollout_config(), dataset_fingerprint=FINGERPRINT, dataset_size=DATASET
        )
        ctl.close()
        assert store.last_seq("r") == 1
        with pytest.raises(RunExistsError):
            RolloutController.start(
                store, "r", rollout_config(), dataset_fingerprint=FINGERPRINT, dataset_size=DATASET
            )
    finally:
        store.close()


def test_open_refuses_a_run_without_its_first_event_and_changes_nothing(
    sqlite_url: str,
) -> None:
    """A run an older rolloutlog left half-created (row, no RunStarted): open says so and
    does not raise the epoch."""
    store = EventStore.open(sqlite_url)
    try:
        store.create_run("r")
        with pytest.raises(RestoreError, match="never started"):
            RolloutController.open(store, "r")
        assert store.get_run("r").current_epoch == 1
    finally:
        store.close()
