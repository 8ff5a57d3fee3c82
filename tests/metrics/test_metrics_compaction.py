"""Metrics survive compaction (issue 11): a compacted run shows the values it showed
before, offline (``project_history``, ``rolloutlog metrics``) and tailed (``LogTailer``).

The scripted run of :mod:`metrics_helpers` (failures, drops, a checkpoint, a crash, a
restore) gets a domain snapshot after step 7 (after the restore, so the abandoned branch
is removed too), is compacted up to it through the controller-side path that saves the
metrics base, and every value is compared with the values before. A compaction by the
library's ``compact`` alone (no metrics base) falls back to the domain snapshot.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from metrics_helpers import ROLLOUT, RUN_ID, run_scenario

from rolloutlog.cli import main as cli_main
from rolloutlog.cli.compact import rollout_snapshot_refs, verify_rollout_snapshot
from rolloutlog.controller.domain.events import RunStarted, SiblingCompleted
from rolloutlog.controller.metrics import EventMeta, LogTailer, MetricsProjection, project_history
from rolloutlog.controller.metrics.retention import (
    compact_with_metrics,
    load_metrics_base,
    metrics_base_id,
)
from rolloutlog.controller.rollout_controller import (
    SNAPSHOT_SCHEMA_VERSION,
    RolloutController,
    replay,
)
from rolloutlog.controller.snapshot_encoder import encode_snapshot
from rolloutlog.eventstore import EventStore
from rolloutlog.eventstore.compaction import CompactedHistoryError, compact

STEP_OF_BASE = 7


def _snapshot_after_step(store: EventStore, step: int) -> int:
    """Write the domain snapshot at the StepTrained of ``step`` in the current history
    (as the controller's background snapshots would); its offset."""
    trained = [r.seq for r in store.read_history(RUN_ID) if r.type == "StepTrained"]
    seq = trained[step]
    state = replay(store, RUN_ID, seq).state
    store.save_snapshot(RUN_ID, seq, SNAPSHOT_SCHEMA_VERSION, encode_snapshot(state))
    return seq


def _tailed(store: EventStore) -> dict:
    tailer = LogTailer(store, RUN_ID)
    tailer.poll()
    follower = tailer.follower
    return follower.projection.values(work=follower.work)


def test_metrics_equal_before_and_after_compaction(db_url: str) -> None:
    run_scenario(db_url)
    store = EventStore.open(db_url)
    try:
        base = _snapshot_after_step(store, STEP_OF_BASE)
        before = project_history(store, RUN_ID).values()
        before_range = project_history(store, RUN_ID, from_seq=base + 1).values()
        assert before["restores"], "the scenario restores before the base"
        assert _tailed(store) == before

        plan = compact_with_metrics(
            store,
            RUN_ID,
            base,
            snapshot_refs=rollout_snapshot_refs,
            verify_snapshot=verify_rollout_snapshot,
        )
        assert plan.snapshot_seq == base and plan.abandoned_events_removed > 0
        assert next(iter(store.read(RUN_ID))).seq == base
        loaded = load_metrics_base(store, RUN_ID)
        assert loaded is not None and loaded.complete and loaded.seq == base

        after = project_history(store, RUN_ID).values()
        # Value for value: the step series (wall_seconds of the steps after the base
        # included), the restore before the base, work-done and history counters, gauges.
        assert after == before
        assert after["steps"][9]["wall_seconds"] == before["steps"][9]["wall_seconds"]
        assert after["steps"][9]["wall_seconds"] > after["steps"][STEP_OF_BASE]["wall_seconds"]
        assert project_history(store, RUN_ID, from_seq=base + 1).values() == before_range
        assert _tailed(store) == before
        # A range that needs the metrics just before a removed offset: a clear error.
        with pytest.raises(CompactedHistoryError, match="compacted up to its snapshot"):
            project_history(store, RUN_ID, from_seq=base)
        with pytest.raises(CompactedHistoryError, match="are gone"):
            project_history(store, RUN_ID, to_seq=base - 1)

        # A tailer that followed the compacted run, then a restore at the checkpoint
        # after the base: it rolls back (the domain state rebuilt by replay) and equals
        # a fresh tailer and the offline fold, both starting at the metrics base.
        warm = LogTailer(store, RUN_ID)
        warm.poll()
        ckpt = max(r.seq for r in store.read_history(RUN_ID) if r.type == "CheckpointMarked")
        assert ckpt > base
        ctl, _ = RolloutController.restore(store, RUN_ID, ckpt, rollout=ROLLOUT)
        ctl.close()
        warm.poll()
        assert warm.follower.rollbacks == 1
        warm_values = warm.follower.projection.values(work=warm.follower.work)
        offline = project_history(store, RUN_ID).values()
        assert warm_values == offline == _tailed(store)
        assert offline["counters"]["rollout_restores_total"] == 2
        assert offline["steps"][: STEP_OF_BASE + 1] == before["steps"][: STEP_OF_BASE + 1]
    finally:
        store.close()


def test_cli_compact_keeps_the_metrics(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    run_scenario(f"sqlite:///{db}")
    store = EventStore.open(f"sqlite:///{db}")
    try:
        base = _snapshot_after_step(store, STEP_OF_BASE)
    finally:
        store.close()
    runner = CliRunner()
    before = runner.invoke(cli_main, ["metrics", f"sqlite:///{db}", "--json"])
    assert before.exit_code == 0, before.output
    dry = runner.invoke(cli_main, ["compact", str(db), "--before", str(base), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    store = EventStore.open(f"sqlite:///{db}")
    try:
        assert load_metrics_base(store, RUN_ID) is None, "a dry run saves nothing"
    finally:
        store.close()
    out = runner.invoke(cli_main, ["compact", str(db), "--before", str(base)])
    assert out.exit_code == 0, out.output
    after = runner.invoke(cli_main, ["metrics", f"sqlite:///{db}", "--json"])
    assert after.exit_code == 0, after.output
    assert json.loads(after.output) == json.loads(before.output)
    store = EventStore.open(f"sqlite:///{db}")
    try:
        assert store.get_payload(RUN_ID, metrics_base_id(base))
    finally:
        store.close()


def test_compaction_without_a_metrics_base_falls_back_to_the_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    run_scenario(url)
    store = EventStore.open(url)
    try:
        base = _snapshot_after_step(store, STEP_OF_BASE)
        before = project_history(store, RUN_ID).values()
        compact(store, RUN_ID, base, snapshot_refs=rollout_snapshot_refs)  # the library alone
        with caplog.at_level(logging.WARNING):
            after = project_history(store, RUN_ID).values()
        assert "no metrics base" in caplog.text
        # The group lifecycle comes from the domain snapshot: the gauges are right...
        gauges = {k: v for k, v in after["gauges"].items() if not k.startswith("rollout_history")}
        assert gauges == {
            k: v for k, v in before["gauges"].items() if not k.startswith("rollout_history")
        }
        # ...the series and counters start after the base.
        assert [r["step"] for r in after["steps"]] == list(range(STEP_OF_BASE + 1, 10))
        assert after["started_at"] > before["started_at"]
    finally:
        store.close()


def test_a_refused_event_is_counted_not_raised() -> None:
    """A log the controller did not write (a completion of a group never admitted) is
    counted as it says; the domain's refusal is counted, the fold goes on."""
    from datetime import UTC, datetime

    proj = MetricsProjection()
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    proj.apply(
        1,
        EventMeta(t0, 0, 0, 1),
        RunStarted(
            run_id="r",
            rollout=ROLLOUT.model_dump(),
            config_fingerprint="f",
            dataset_fingerprint="d",
            dataset_size=10,
        ),
    )
    proj.apply(
        2,
        EventMeta(t0, 0, 0, 1),
        SiblingCompleted(
            group_id=99,
            sibling=0,
            attempt=1,
            weight_version=0,
            prompt_tokens=2,
            completion_tokens=5,
            reward=1.0,
            payload_id="p",
            finish_reason="stop",
        ),
    )
    assert proj.domain_errors == 1 and "offset 2" in (proj.last_domain_error or "")
    assert proj.counts["tokens_generated"] == 5
    assert proj.state is not None and proj.state.last_seq == 2
