"""The embedded exporter serves no fold metrics until its catch-up from the log is done:
a process resuming a run would otherwise show its counters climbing from 0 while it
folds the log, which Prometheus reads as a reset of the previous process's values."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.metrics import LiveMetrics
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore


def test_no_counters_until_caught_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    ctl = RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=2),
        dataset_fingerprint="catch-up",
        dataset_size=10,
        store_config=StoreConfig(snapshot_interval=0),
    )
    live = LiveMetrics()
    release = threading.Event()
    original = live.follower.sync

    def slow_sync(*args: object, **kwargs: object) -> int:
        assert release.wait(30), "the test never released the catch-up"
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(live.follower, "sync", slow_sync)
    try:
        live.attach(ctl, background=True)
        during = {f.name for f in live.families()}
        assert not any(name.endswith("_total") for name in during), during
        assert "rollout_log_offset" not in during
        release.set()
        assert live.wait_caught_up(30)
        after = {f.name: f for f in live.families()}
        by_type = {s.labels["type"]: s.value for s in after["rollout_events_total"].samples}
        assert by_type["RunStarted"] == 1 and sum(by_type.values()) == 1
        assert after["rollout_log_offset"].samples[0].value == 1
    finally:
        release.set()
        live.detach()
        ctl.close()
        store.close()
