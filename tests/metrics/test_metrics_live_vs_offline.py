"""The live metrics equal their offline recomputation over the same log (docs/metrics.md).

A run with retried and exhausted failures, dropped and evicted prompts, borrows, a
checkpoint, work after it, a crash and a restore is driven through RolloutController +
RolloutRuntime with the deterministic backend, on SQLite and PostgreSQL. LiveMetrics
follows it through the controllers' listeners; afterwards the projection is recomputed
from the log with iter_history and every value is compared (the live-only timings
aside: the log does not hold them).
"""

from __future__ import annotations

from metrics_helpers import ROLLOUT, RUN_ID, Scenario, run_scenario

from rolloutlog.controller.domain.events import CODEC, SiblingCompleted, StepTrained
from rolloutlog.controller.metrics import MetricsProjection, fold_rows, project_history
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore


def _offline(url: str) -> MetricsProjection:
    store = EventStore.open(url)
    try:
        return fold_rows(iter_history(store, RUN_ID))
    finally:
        store.close()


def _labelled(values: dict, name: str, **labels: str) -> int:
    for sample in values["counters"][name]:
        if all(sample[k] == v for k, v in labels.items()):
            return sample["value"]
    raise AssertionError(f"no {name}{labels}")


def _check_against_state(sc: Scenario, v: dict) -> None:
    """The projection agrees with the controller's own state (a separate fold)."""
    st, c = sc.final_state_values, v["counters"]
    assert c["rollout_tokens_generated_total"] == st["tokens_generated"]
    assert c["rollout_tokens_committed_total"] == st["tokens_committed"]
    assert c["rollout_groups_committed_total"] == st["groups_committed"]
    assert c["rollout_groups_trained_total"] == st["groups_trained"]
    assert c["rollout_replacements_total"] == st["replacements"]
    assert c["rollout_borrows_total"] == st["borrows"]
    assert c["rollout_siblings_completed_total"] == st["siblings_completed"]
    assert c["rollout_siblings_aborted_total"] == st["siblings_aborted"]
    assert c["rollout_batch_shortfall_groups_total"] == st["shortfall"]
    assert c["rollout_prompts_pulled_total"] == st["dataset_cursor"]
    failed = sum(s["value"] for s in c["rollout_siblings_failed_total"])
    assert failed == st["siblings_failed"]
    assert sum(s["value"] for s in c["rollout_prompts_dropped_total"]) == st["prompts_dropped"]
    evicted = c["rollout_groups_evicted_total"]
    assert sum(s["value"] for s in evicted) == st["groups_evicted"]
    recovered = sum(s["value"] for s in evicted if s["recovered"] == "true")
    assert recovered == st["groups_evicted_recovered"]
    g = v["gauges"]
    assert g["rollout_siblings_in_flight"] == st["in_flight"]
    assert g["rollout_buffer_groups"] == st["ready"]
    assert g["rollout_groups_generating"] == st["admitted"]
    assert g["rollout_spare_groups"] == st["spares"]
    assert g["rollout_train_step"] == st["train_step"]
    assert g["rollout_weight_version"] == st["weight_version"]
    assert g["rollout_published_weight_version"] == st["published_version"]
    assert g["rollout_epoch"] == st["epoch"]
    assert g["rollout_log_offset"] == st["last_seq"]


def test_live_equals_offline_across_failures_and_a_restore(db_url: str) -> None:
    sc = run_scenario(db_url)
    live = sc.live
    assert live.listener_errors == 0
    live_values = live.projection.values()
    offline_values = _offline(db_url).values()
    # Every projection value, including the step and restore series and their times.
    assert live_values == offline_values
    # With the work done (every stored event, all epochs): live equals offline too.
    live_work = {k: v for k, v in live.values().items() if k != "live"}
    offline_work = project_history_values(db_url)
    assert live_work == offline_work
    assert offline_work["history_counters"] == offline_values["counters"]
    assert offline_work["gauges"] == offline_values["gauges"]
    _check_work_done(db_url, offline_work)

    # Not vacuous: most events went through the listener, and the restore abandoned
    # folded work (completions after the checkpoint) that the rollback removed.
    assert live.follower.rollbacks == 1 and live.follower.recomputes == 0
    store = EventStore.open(db_url)
    try:
        history = store.history_segments(RUN_ID)
        last = store.last_seq(RUN_ID)
        abandoned = [
            row
            for row in store.read(RUN_ID, history[0][1] + 1, history[1][0] - 1)
            if row.type == SiblingCompleted.event_type
        ]
    finally:
        store.close()
    assert len(history) == 2 and history[0][1] == sc.checkpoint_offset
    assert abandoned, "the crash should leave completed work after the checkpoint"
    assert live_values["offset"] == last
    assert live_values["history"] == [list(s) for s in history]

    v = live_values
    c = v["counters"]
    # The script exercised what it should.
    assert c["rollout_restores_total"] == 1
    assert c["rollout_checkpoints_total"] == 2  # one before the crash, one after restore
    assert _labelled(v, "rollout_siblings_failed_total", retryable="true") >= 2
    assert sum(s["value"] for s in c["rollout_prompts_dropped_total"]) >= 1
    assert _labelled(v, "rollout_groups_evicted_total", reason="stale") >= 1
    assert c["rollout_tokens_generated_total"] >= c["rollout_tokens_committed_total"] > 0
    assert c["rollout_groups_trained_total"] == 10 * ROLLOUT.groups_per_step
    _check_against_state(sc, v)

    # Recovery counts are the restore's report.
    report = sc.report
    assert report is not None
    assert _labelled(v, "rollout_recovery_groups_total", kind="complete") == (
        report.complete_groups_restored
    )
    assert _labelled(v, "rollout_recovery_groups_total", kind="unfinished") == (
        report.unfinished_groups_found
    )
    assert _labelled(v, "rollout_recovery_siblings_total", kind="reused") == report.siblings_reused
    assert _labelled(v, "rollout_recovery_siblings_total", kind="rerun") == report.siblings_rerun
    assert _labelled(v, "rollout_recovery_siblings_total", kind="salvaged") == (
        report.siblings_salvaged
    )

    # The train-step axis: one row per trained step of the history, rewards as trained.
    steps = v["steps"]
    assert [r["step"] for r in steps] == list(range(10))
    assert [r["reward_mean"] for r in steps] == [sc.rewards[i] for i in range(10)]
    # The wall-clock axis keeps increasing across the restart (log time, not process time).
    times = [r["time"] for r in steps]
    walls = [r["wall_seconds"] for r in steps]
    assert times == sorted(times) and walls == sorted(walls) and walls[0] > 0
    (restore,) = v["restores"]
    assert restore["from_offset"] == sc.checkpoint_offset
    assert restore["rolled_back_seconds"] > 0
    assert steps[3]["time"] < restore["time"] < steps[4]["time"]
    assert [r["epoch"] for r in steps] == [1] * 4 + [2] * 6

    # The live-only timings were collected (and are not part of the comparison above).
    timings = live.values()["live"]
    assert timings["rollout_log_append_seconds"]["count"] > 0
    assert timings["rollout_checkpoint_seconds"]["count"] == 2
    assert timings["rollout_restore_phase_seconds"] == report.timings
    assert "live" not in offline_values


def _check_work_done(url: str, v: dict) -> None:
    """The work-done counters count every stored event once (all epochs), salvaged
    completions aside, and are never below the history's counts."""
    store = EventStore.open(url)
    try:
        rows = [(row, CODEC.decode(row)) for row in store.read(RUN_ID, 1)]
    finally:
        store.close()
    c, h = v["counters"], v["history_counters"]
    assert sum(s["value"] for s in c["rollout_events_total"]) == len(rows)
    completed = [ev for _, ev in rows if isinstance(ev, SiblingCompleted)]
    fresh = [ev for ev in completed if ev.salvaged_from is None]
    assert c["rollout_siblings_completed_total"] == len(fresh)
    assert c["rollout_tokens_generated_total"] == sum(ev.completion_tokens for ev in fresh)
    trained = sum(1 for _, ev in rows if isinstance(ev, StepTrained))
    assert trained > 10  # steps trained in the abandoned branch count too
    assert c["rollout_groups_trained_total"] > h["rollout_groups_trained_total"]
    for name, value in c.items():
        if isinstance(value, list):
            mine = {tuple(sorted(x.items())): x["value"] for x in value}
            for sample in h[name]:
                key = tuple(sorted(sample.items()))
                assert sample["value"] <= max(
                    (n for k, n in mine.items() if k[:-1] == key[:-1]), default=0
                ), name
        else:
            assert value >= h[name], name


def project_history_values(url: str) -> dict:
    """The offline recomputation through the public helper (the CLI's path)."""
    store = EventStore.open(url)
    try:
        return project_history(store, RUN_ID).values()
    finally:
        store.close()


def test_live_equals_offline_after_a_takeover(sqlite_url: str) -> None:
    """RolloutController.open (no rollback, a new epoch): the Resume event is caught up
    from the log and the follower needs no rollback."""
    sc = run_scenario(sqlite_url, steps_before_crash=5, total_steps=8, reopen="resume")
    assert sc.live.listener_errors == 0
    live_values = sc.live.projection.values()
    assert live_values == _offline(sqlite_url).values()
    assert sc.live.follower.rollbacks == 0 and sc.live.follower.recomputes == 0
    assert live_values["counters"]["rollout_resumes_total"] == 1
    assert live_values["counters"]["rollout_restores_total"] == 0
    assert len(live_values["history"]) == 1
    _check_against_state(sc, live_values)
