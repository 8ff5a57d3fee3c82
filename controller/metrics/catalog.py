"""The metric catalog: every metric rolloutlog exports, with its kind, unit, labels and
meaning, and the label values the fold uses (see ``docs/metrics.md``).

Only names and descriptions live here; the values come from the fold
(:mod:`rolloutlog.controller.metrics.fold`) and are rendered by
:mod:`rolloutlog.controller.metrics.exposition`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..domain.events import CODEC

MetricKind = Literal["counter", "gauge", "histogram"]

#: Buckets of ``rollout_selected_group_staleness`` (weight versions). Staleness is an
#: integer: one bucket per value up to 16 keeps a quantile exact there (the bucket
#: ``(k-1, k]`` holds only ``k``; the dashboard rounds the interpolated quantile up).
STALENESS_BUCKETS: tuple[float, ...] = (*range(17), 24, 32, 64)

#: The engine label value of engines past ``telemetry.max_engine_labels`` (a label value,
#: not a tunable).
OTHER_ENGINE = "other"
#: Values of the ``outcome`` label of ``rollout_prompts_dropped_total`` (what filled the slot).
DROP_OUTCOMES: tuple[str, ...] = ("replaced", "borrowed", "shrunk", "unreplaced", "run_failed")
#: Buckets of ``rollout_trajectory_turns`` (model calls per completed trajectory): one per
#: value up to 16, as for staleness.
TURN_BUCKETS: tuple[float, ...] = (*range(1, 17), 24, 32, 64)
#: Buckets of ``rollout_tool_call_seconds``.
TOOL_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
#: Tools that get their own value of the ``tool`` label (in order of first request); later
#: tools, and a result whose request the fold did not see, count as ``tool="other"``, so
#: environments with many (or generated) method names cannot grow the series without bound.
MAX_TOOL_LABELS = 32
#: The tool label value past :data:`MAX_TOOL_LABELS` (a label value, not a tunable).
OTHER_TOOL = "other"
#: Values of the ``outcome`` label of ``rollout_tool_failures_total``.
TOOL_FAILURE_OUTCOMES: tuple[str, ...] = ("error", "not_rerun")
#: Values of the ``type`` label of ``rollout_events_total``: every rollout event type,
#: exported at 0 before its first event so that ``increase()`` counts that event.
EVENT_TYPES: tuple[str, ...] = tuple(CODEC.types)


@dataclass(frozen=True, slots=True)
class MetricInfo:
    """One exported metric: its kind, unit, labels and meaning."""

    kind: MetricKind
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    live_only: bool = False


#: Every metric rolloutlog exports, by the name its samples carry in Prometheus.
METRICS: dict[str, MetricInfo] = {
    # ---------------------------------------------------------------- tokens
    "rollout_tokens_generated_total": MetricInfo(
        "counter", "tokens", "Completion tokens of every finished sibling (generated work)."
    ),
    "rollout_tokens_committed_total": MetricInfo(
        "counter",
        "tokens",
        "Completion tokens of the groups that entered the replay buffer (all siblings done).",
    ),
    # ---------------------------------------------------------------- prompts and siblings
    "rollout_prompts_pulled_total": MetricInfo(
        "counter", "prompts", "Prompts pulled from the dataset (into a step or the spare pool)."
    ),
    "rollout_siblings_dispatched_total": MetricInfo(
        "counter", "siblings", "Sibling attempts sent to generation."
    ),
    "rollout_siblings_completed_total": MetricInfo(
        "counter", "siblings", "Sibling attempts that finished with a completion."
    ),
    "rollout_siblings_failed_total": MetricInfo(
        "counter",
        "siblings",
        "Sibling attempts that failed, by whether another attempt may follow.",
        ("retryable",),
    ),
    "rollout_reward_failures_total": MetricInfo(
        "counter",
        "siblings",
        "Sibling attempts failed by their reward (a SiblingFailed with cause reward).",
    ),
    "rollout_siblings_aborted_total": MetricInfo(
        "counter", "siblings", "Sibling attempts abandoned (stale weights, backend abort)."
    ),
    # ---------------------------------------------------------------- groups
    "rollout_groups_committed_total": MetricInfo(
        "counter", "groups", "Groups whose siblings all finished (entered the replay buffer)."
    ),
    "rollout_groups_selected_total": MetricInfo(
        "counter", "groups", "Groups put into a training batch."
    ),
    "rollout_groups_trained_total": MetricInfo(
        "counter", "groups", "Groups of the batches the trainer reported as trained."
    ),
    "rollout_batch_shortfall_groups_total": MetricInfo(
        "counter", "groups", "Groups missing from trained batches (recorded shortfall)."
    ),
    "rollout_groups_evicted_total": MetricInfo(
        "counter",
        "groups",
        "Groups removed unused; reason=stale beyond the staleness bound, other otherwise; "
        "recovered=true for groups that came back in a restore.",
        ("reason", "recovered"),
    ),
    "rollout_prompts_dropped_total": MetricInfo(
        "counter",
        "prompts",
        "Prompts that left the run unfinished (attempts exhausted), by what filled the slot.",
        ("outcome",),
    ),
    "rollout_replacements_total": MetricInfo(
        "counter", "groups", "Spare prompts stamped to replace a dropped or evicted group."
    ),
    "rollout_borrows_total": MetricInfo(
        "counter", "groups", "Ready groups moved from a later step to fill a short step."
    ),
    "rollout_selected_group_staleness": MetricInfo(
        "histogram",
        "weight versions",
        "Staleness of each selected group: trainer weight version minus the group's oldest "
        "sibling version (weight versions).",
    ),
    # ---------------------------------------------------------------- gauges
    "rollout_siblings_in_flight": MetricInfo(
        "gauge", "siblings", "Siblings dispatched and not yet finished, failed or aborted."
    ),
    "rollout_groups_generating": MetricInfo(
        "gauge", "groups", "Groups admitted and not yet complete (in flight or partial)."
    ),
    "rollout_buffer_groups": MetricInfo(
        "gauge", "groups", "Ready groups waiting in the replay buffer."
    ),
    "rollout_spare_groups": MetricInfo("gauge", "groups", "Prompts held in the spare pool."),
    "rollout_train_step": MetricInfo(
        "gauge", "steps", "Train steps trained so far (= the next step to train)."
    ),
    "rollout_weight_version": MetricInfo("gauge", "versions", "The trainer's weight version."),
    "rollout_published_weight_version": MetricInfo(
        "gauge", "versions", "The weight version generation serves."
    ),
    "rollout_batch_reward_mean": MetricInfo(
        "gauge", "reward", "Mean reward over the siblings of the last trained batch."
    ),
    "rollout_epoch": MetricInfo(
        "gauge", "epochs", "The run's epoch (raised by every restore or takeover)."
    ),
    "rollout_log_offset": MetricInfo(
        "gauge", "events", "Offset of the newest event in these metrics."
    ),
    "rollout_last_event_timestamp_seconds": MetricInfo(
        "gauge", "seconds", "Wall-clock time (Unix, UTC) the newest event was recorded."
    ),
    # ---------------------------------------------------------------- history state
    "rollout_history_tokens_generated": MetricInfo(
        "gauge",
        "tokens",
        "Completion tokens generated in the run's current history (falls back at a restore).",
    ),
    "rollout_history_tokens_committed": MetricInfo(
        "gauge", "tokens", "Completion tokens of the groups committed in the current history."
    ),
    "rollout_history_groups_committed": MetricInfo(
        "gauge", "groups", "Groups committed in the current history (falls back at a restore)."
    ),
    "rollout_history_groups_trained": MetricInfo(
        "gauge", "groups", "Groups trained in the current history (falls back at a restore)."
    ),
    "rollout_history_events": MetricInfo(
        "gauge", "events", "Events in the current history (falls back at a restore)."
    ),
    # ---------------------------------------------------------------- checkpoints, restores
    "rollout_checkpoints_total": MetricInfo(
        "counter", "checkpoints", "Checkpoint markers written."
    ),
    "rollout_restores_total": MetricInfo(
        "counter", "restores", "Restores from a checkpoint (each opens a new epoch)."
    ),
    "rollout_resumes_total": MetricInfo(
        "counter", "resumes", "Takeovers of the run where it stood (no rollback)."
    ),
    "rollout_recovery_groups_total": MetricInfo(
        "counter",
        "groups",
        "Groups found by restores: kind=complete (ready or selected, restored as they "
        "were), kind=unfinished (in flight at the checkpoint, generated again).",
        ("kind",),
    ),
    "rollout_recovery_siblings_total": MetricInfo(
        "counter",
        "siblings",
        "Siblings of unfinished groups at restores: kind=reused (finished before the "
        "checkpoint), kind=rerun (generated again), kind=salvaged (finished after the "
        "checkpoint by weights the restored trainer has).",
        ("kind",),
    ),
    "rollout_engine_siblings_completed_total": MetricInfo(
        "counter",
        "siblings",
        "Sibling completions by the engine that generated them (in-process backends have no "
        'engine and are not counted; engines past telemetry.max_engine_labels: "other").',
        ("engine",),
    ),
    "rollout_engine_losses_total": MetricInfo(
        "counter",
        "engines",
        "Engines lost (EngineLost events), by engine (bounded like the completions).",
        ("engine",),
    ),
    # ---------------------------------------------------------------- multi-turn
    "rollout_trajectory_turns": MetricInfo(
        "histogram",
        "turns",
        "Model calls (turns) of each completed multi-turn trajectory (TrajectoryCompleted).",
    ),
    "rollout_tool_call_seconds": MetricInfo(
        "histogram",
        "seconds",
        "Seconds each tool call took (or its status check after a restore), completed or "
        "failed, as recorded in ToolCallCompleted / ToolCallFailed.",
    ),
    "rollout_tool_failures_total": MetricInfo(
        "counter",
        "tool calls",
        "Tool calls that failed, by tool and outcome (error: the tool raised; not_rerun: "
        f"interrupted and not run twice). The first {MAX_TOOL_LABELS} tools requested get "
        'their own label value, later ones "other"; each is exported at 0 from its first '
        "request.",
        ("tool", "outcome"),
    ),
    "rollout_events_total": MetricInfo(
        "counter", "events", "Events stored for the run (all epochs), by event type.", ("type",)
    ),
    # ---------------------------------------------------------------- live only
    "rollout_log_append_seconds": MetricInfo(
        "histogram",
        "seconds",
        "Seconds each log append transaction took (live only: the log does not record it).",
        live_only=True,
    ),
    "rollout_checkpoint_seconds": MetricInfo(
        "histogram",
        "seconds",
        "Seconds from a checkpoint request until its marker was durable (live only).",
        live_only=True,
    ),
    "rollout_restore_phase_seconds": MetricInfo(
        "gauge",
        "seconds",
        "Seconds the last restore spent in each phase (live only).",
        ("phase",),
        live_only=True,
    ),
}


#: Plain counters: exported name -> key in the fold's ``counts``.
PLAIN_COUNTERS: dict[str, str] = {
    "rollout_tokens_generated_total": "tokens_generated",
    "rollout_tokens_committed_total": "tokens_committed",
    "rollout_prompts_pulled_total": "prompts_pulled",
    "rollout_siblings_dispatched_total": "siblings_dispatched",
    "rollout_siblings_completed_total": "siblings_completed",
    "rollout_siblings_aborted_total": "siblings_aborted",
    "rollout_reward_failures_total": "reward_failures",
    "rollout_groups_committed_total": "groups_committed",
    "rollout_groups_selected_total": "groups_selected",
    "rollout_groups_trained_total": "groups_trained",
    "rollout_batch_shortfall_groups_total": "shortfall",
    "rollout_replacements_total": "replacements",
    "rollout_borrows_total": "borrows",
    "rollout_checkpoints_total": "checkpoints",
    "rollout_restores_total": "restores",
    "rollout_resumes_total": "resumes",
}


#: History-state gauges: exported name -> key in the fold's ``counts``
#: (``rollout_history_events`` is the sum over event types).
HISTORY_GAUGES: dict[str, str] = {
    "rollout_history_tokens_generated": "tokens_generated",
    "rollout_history_tokens_committed": "tokens_committed",
    "rollout_history_groups_committed": "groups_committed",
    "rollout_history_groups_trained": "groups_trained",
}
