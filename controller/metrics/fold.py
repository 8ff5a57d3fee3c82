"""The metrics fold: one fold over the log's events, live or offline.

:class:`MetricsProjection` is the only code that turns events into metric values. The
live path (a controller listener, see :mod:`rolloutlog.controller.metrics.live`) and the offline
path (rows read back with :func:`rolloutlog.controller.rollout_controller.iter_history`) call the
same :meth:`MetricsProjection.apply` with the same inputs: the event's offset, the stored
row's metadata (:class:`EventMeta`: ``recorded_at`` UTC, the train step and weight
version at that moment, the epoch) and the decoded event. So a projection computed live
and the same projection recomputed from the log are equal, value for value.

The group lifecycle is not re-implemented here: the projection holds a domain
:class:`~rolloutlog.controller.domain.state.RunState` and applies every event to it with
the domain's own ``evolve`` (the function the controller folds with), so the group
gauges, the tokens a group commits (the sum over its finished siblings) and the rewards
of a trained batch are read from the same state the controller has. On top of that the
fold keeps what the log's metrics need and the domain does not: counters (work-done and
history), and two time series, one row per trained step and one per restore. Timing
metrics that the log cannot know (append latency, checkpoint and restore durations) are
not part of the fold; they live in :class:`rolloutlog.controller.metrics.live.LiveTimings`.

A compacted run (``rolloutlog compact``) no longer holds the events before its base:
the fold then resumes from the *metrics base* saved with the compaction (see
:mod:`rolloutlog.controller.metrics.retention`), so counters, series and wall-clock times
are those of the whole run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from ..config import TelemetryConfig
from ..domain.decider import evolve
from ..domain.events import (
    CODEC,
    BatchSelected,
    CheckpointMarked,
    EngineJoined,
    EngineLost,
    EngineRefit,
    GroupAdmitted,
    GroupBorrowed,
    GroupCommitted,
    GroupEvicted,
    GroupSelected,
    PromptDropped,
    RolloutEvent,
    RunRestored,
    RunResumed,
    RunStarted,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
    SpareAssigned,
    SparePulled,
    StepAdmitted,
    StepTrained,
    WeightsPublished,
)
from ..domain.state import Phase, RunState, SiblingStatus
from ..domain.trajectory import (
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryCompleted,
)
from ..rollout_index import IndexedEvent
from .catalog import (
    DROP_OUTCOMES,
    EVENT_TYPES,
    HISTORY_GAUGES,
    MAX_TOOL_LABELS,
    OTHER_ENGINE,
    OTHER_TOOL,
    PLAIN_COUNTERS,
    TOOL_FAILURE_OUTCOMES,
    TOOL_SECONDS_BUCKETS,
)
from .exposition import Family, projection_families, projection_values

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventMeta:
    """What the stored row says about an event besides the event itself."""

    recorded_at: datetime  # wall-clock UTC when the controller recorded the event
    train_step: int | None  # steps trained at that moment
    weight_version: int | None  # trainer weight version at that moment
    epoch: int

    @classmethod
    def of_row(cls, row: IndexedEvent) -> EventMeta:
        """The metadata of a stored row with its rollout index keys."""
        return cls(row.recorded_at, row.train_step, row.weight_version, row.epoch)


def _row_dict(row: StepRow | RestoreRow) -> dict[str, Any]:
    """A row's fields in their order, JSON-friendly (``time`` as ISO 8601 UTC)."""
    out = {f.name: getattr(row, f.name) for f in fields(row)}
    out["time"] = row.time.isoformat()
    return out


@dataclass(frozen=True, slots=True)
class StepRow:
    """The train-step axis: one row per trained step (cumulative counts at that step)."""

    step: int
    offset: int
    time: datetime
    wall_seconds: float  # since the run started (log time: keeps increasing across restarts)
    epoch: int
    weight_version: int
    groups: int
    shortfall: int
    reward_mean: float | None
    staleness_max: int | None
    staleness_mean: float | None
    tokens_generated: int
    tokens_committed: int
    groups_committed: int
    groups_evicted: int
    prompts_dropped: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (time as ISO 8601 UTC)."""
        return _row_dict(self)


@dataclass(frozen=True, slots=True)
class RestoreRow:
    """One restore as the log records it.

    ``rolled_back_seconds`` is the log time between the checkpoint it restored and the
    restore itself: the wall-clock time the run lost (work after the checkpoint plus any
    downtime). The durations of the restore's own phases are not in the log.
    """

    offset: int
    time: datetime
    wall_seconds: float
    epoch: int
    from_offset: int
    mode: str
    granularity: str
    checkpoint_train_step: int
    checkpoint_weight_version: int
    rolled_back_seconds: float | None
    complete_groups_restored: int
    unfinished_groups_found: int
    siblings_reused: int
    siblings_rerun: int
    siblings_salvaged: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (time as ISO 8601 UTC)."""
        return _row_dict(self)


class _CounterContainers:
    """The counter containers :class:`MetricsProjection` (one history) and
    :class:`WorkTotals` (every stored event) both keep, zeroed (see ``_COUNTER_FIELDS``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(PLAIN_COUNTERS.values(), 0)
        self.failed: dict[str, int] = {"true": 0, "false": 0}
        self.evicted: dict[tuple[str, str], int] = {
            (r, c): 0 for r in ("stale", "other") for c in ("true", "false")
        }
        self.dropped: dict[str, int] = dict.fromkeys(DROP_OUTCOMES, 0)
        self.recovery_groups: dict[str, int] = {"complete": 0, "unfinished": 0}
        self.recovery_siblings: dict[str, int] = {"reused": 0, "rerun": 0, "salvaged": 0}
        self.events_by_type: dict[str, int] = dict.fromkeys(EVENT_TYPES, 0)
        self.engine_completed: dict[str, int] = {OTHER_ENGINE: 0}
        self.engine_lost: dict[str, int] = {OTHER_ENGINE: 0}
        #: The exact staleness distribution of the selected groups (staleness -> groups):
        #: the staleness histogram's buckets are derived from it when read.
        self.staleness_values: dict[int, int] = {}
        #: The exact distribution of turns per completed trajectory (turns -> trajectories).
        self.trajectory_turns: dict[int, int] = {}
        #: Tool call seconds as bucket counts: key i is bucket i of
        #: ``TOOL_SECONDS_BUCKETS`` (``len`` of it: +Inf), key -1 the sum in microseconds.
        self.tool_seconds: dict[int, int] = {}
        #: Failed tool calls by (tool label, outcome).
        self.tool_failures: dict[tuple[str, str], int] = {
            (OTHER_TOOL, o): 0 for o in TOOL_FAILURE_OUTCOMES
        }


class WorkTotals(_CounterContainers):
    """Work done by a run: the counters summed over **every stored event** of the run,
    abandoned branches included (what the exported ``*_total`` counters show: they only
    grow, across restores). Work redone after a restore counts again; completions
    *salvaged* by a restore (``salvaged_from`` set) do not. The history's own counts stay
    on :class:`MetricsProjection` (``history_counters``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0  # the newest event counted

    def copy(self) -> WorkTotals:
        """An independent copy."""
        other = WorkTotals()
        other.offset = self.offset
        for name in _COUNTER_FIELDS:
            setattr(other, name, dict(getattr(self, name)))
        return other

    def to_snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the totals (:meth:`from_snapshot` reads it back)."""
        return {"offset": self.offset, **_counters_to_snapshot(self)}

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any]) -> WorkTotals:
        """The totals :meth:`to_snapshot` described."""
        out = cls()
        out.offset = int(data["offset"])
        _counters_from_snapshot(out, data)
        return out


#: The counter containers shared by :class:`MetricsProjection` and :class:`WorkTotals`.
_COUNTER_FIELDS = (
    "counts",
    "failed",
    "evicted",
    "dropped",
    "recovery_groups",
    "recovery_siblings",
    "events_by_type",
    "engine_completed",
    "engine_lost",
    "staleness_values",
    "trajectory_turns",
    "tool_seconds",
    "tool_failures",
)


def _counters_to_snapshot(src: _CounterContainers) -> dict[str, Any]:
    """The counter containers of ``src``, JSON-friendly (keys as ``[key, value]`` pairs:
    some keys are tuples or integers)."""
    return {
        name: [[list(k) if isinstance(k, tuple) else k, v] for k, v in getattr(src, name).items()]
        for name in _COUNTER_FIELDS
    }


def _counters_from_snapshot(dst: _CounterContainers, data: Mapping[str, Any]) -> None:
    """Set the counter containers of ``dst`` from :func:`_counters_to_snapshot`'s output.

    Keys a snapshot lacks (event types added since it was written) stay at 0, and so do
    containers it lacks (the multi-turn ones). No histogram is stored: the staleness
    histogram is derived from ``staleness_values`` (in every snapshot layout) when read,
    so the ``staleness`` key of older snapshots is ignored.
    """
    for name in _COUNTER_FIELDS:
        if name not in data:
            continue
        values = {tuple(k) if isinstance(k, list) else k: int(v) for k, v in data[name]}
        setattr(dst, name, {**getattr(dst, name), **values})


class MetricsProjection(_CounterContainers):
    """The metrics fold: :meth:`apply` one event after another, read :meth:`families`,
    :meth:`values`, :attr:`steps` and :attr:`restores`.

    Events must come in offset order; the offsets applied are remembered as ranges
    (:attr:`applied_segments`) so a follower can tell whether the projection is still a
    prefix of the log's current history (see :meth:`consistent_with`).

    :attr:`state` is the domain state of the history folded so far (the domain's
    ``evolve``): the group gauges and per-group sums are read from it. If ``evolve``
    refuses an event (a log the controller did not write), the fold goes on: the event's
    counters and series still count, the refusal is counted in :attr:`domain_errors` and
    logged, and the group takes the phase the event states (``_REFUSED_PHASE``).
    """

    def __init__(self, max_engine_labels: int | None = None) -> None:
        super().__init__()
        self.run_id: str | None = None
        #: Engines with their own label value (the rest count as ``other``).
        self.max_engine_labels = (
            TelemetryConfig().max_engine_labels if max_engine_labels is None else max_engine_labels
        )
        self._engine_labels: set[str] = set()
        self._tool_labels: set[str] = set()
        #: The tool of each call requested and not answered yet (a failure names its
        #: call by idempotency key only).
        self._open_tools: dict[str, str] = {}
        self.offset = 0
        self.applied_segments: list[tuple[int, int]] = []
        self.epoch = 0
        self.started_at: datetime | None = None
        self.last_meta: EventMeta | None = None
        self.staleness_bound: int | None = None
        self.train_step = 0
        self.weight_version = 0
        self.published_version = 0
        self.last_reward_mean: float | None = None
        self.last_checkpoint: tuple[int, datetime] | None = None
        self.steps: list[StepRow] = []
        self.restores: list[RestoreRow] = []
        #: The domain state at :attr:`offset` (None only in a copy taken without it,
        #: see :meth:`copy`; such a copy cannot fold until it gets one).
        self.state: RunState | None = RunState()
        #: Events the domain's ``evolve`` refused (see the class docstring).
        self.domain_errors = 0
        self.last_domain_error: str | None = None
        self._checkpoint_times: dict[int, datetime] = {}
        #: Where the work done is summed as well (set by a follower; never copied).
        self.work: WorkTotals | None = None

    @classmethod
    def from_domain_state(
        cls, state: RunState, applied_segments: Sequence[tuple[int, int]]
    ) -> MetricsProjection:
        """A projection that starts at ``state`` (a domain snapshot at
        ``state.last_seq``) without knowing what came before it: the group gauges and
        the train step, weight versions and epoch are right; counters, series and
        ``started_at`` (the origin of ``wall_seconds``) start with the next event.

        The fallback for a compacted run whose metrics base is missing;
        ``applied_segments``: the history up to ``state.last_seq``."""
        proj = cls()
        proj.state = state
        proj.run_id = state.run_id
        proj.offset = state.last_seq
        proj.applied_segments = [(a, min(b, state.last_seq)) for a, b in applied_segments]
        proj.epoch = state.epoch
        if state.config is not None:
            proj.staleness_bound = state.config.staleness_bound
        proj.train_step = state.train_step
        proj.weight_version = state.weight_version
        proj.published_version = state.published_version
        return proj

    # ------------------------------------------------------------------ folding
    def _add(self, field_name: str, key: Any, n: int = 1, *, work: bool = True) -> None:
        """Count ``n`` under ``key`` of a counter container, in the history's counts and
        (unless ``work`` is false) in the work totals."""
        mine = getattr(self, field_name)
        mine[key] = mine.get(key, 0) + n
        if work and self.work is not None:
            theirs = getattr(self.work, field_name)
            theirs[key] = theirs.get(key, 0) + n

    def apply(self, offset: int, meta: EventMeta, event: RolloutEvent) -> None:
        """Fold the event stored at ``offset`` (offsets must increase).

        The metric handlers read the domain state *before* the event (e.g. the rewards
        of a batch, whose groups leave the state when it is trained), then the event is
        applied to the state with the domain's ``evolve``.
        """
        if offset <= self.offset:
            raise ValueError(f"event at offset {offset} applied after offset {self.offset}")
        if self.state is None:
            raise RuntimeError("this projection copy has no domain state: it cannot fold")
        if self.applied_segments and self.applied_segments[-1][1] + 1 == offset:
            self.applied_segments[-1] = (self.applied_segments[-1][0], offset)
        else:
            self.applied_segments.append((offset, offset))
        self.offset = offset
        if self.work is not None:
            self.work.offset = offset
        self.last_meta = meta
        self.epoch = meta.epoch
        if self.started_at is None:
            self.started_at = meta.recorded_at
        self._add("events_by_type", event.event_type)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, offset, meta, event)
        self._evolve(self.state, offset, event)

    def _evolve(self, state: RunState, offset: int, event: RolloutEvent) -> None:
        """Apply ``event`` to the domain state; a refusal is counted, never raised."""
        try:
            evolve(state, event, offset)
        except Exception as exc:  # a metrics reader never stops on the log it reads
            state.last_seq = max(state.last_seq, offset)
            _follow_refused(state, event)
            self.domain_errors += 1
            self.last_domain_error = f"offset {offset} ({event.event_type}): {exc}"
            level = logging.WARNING if self.domain_errors == 1 else logging.DEBUG
            log.log(
                level,
                "metrics: the domain refused the event at offset %s (%s): %s; the group "
                "gauges may be off from here (further refusals are logged at debug level)",
                offset,
                event.event_type,
                exc,
            )

    def apply_row(self, row: IndexedEvent, event: RolloutEvent | None = None) -> None:
        """Fold a stored row (decoded here unless ``event`` is given)."""
        if event is None:
            event = CODEC.decode(row)  # type: ignore[assignment]
        assert event is not None
        self.apply(row.seq, EventMeta.of_row(row), event)

    def copy(self, *, state: bool = True) -> MetricsProjection:
        """An independent copy (rows are immutable and shared).

        ``state=False``: without the domain state (:attr:`state` is None): cheap, for
        copies that are only read (a range's base) or get a state rebuilt by the domain's
        replay before folding again (a follower's checkpoint copies: copying a state of
        100k groups at every checkpoint would cost seconds in the run's process).
        """
        other = MetricsProjection.__new__(MetricsProjection)
        for name in _SCALAR_FIELDS:
            setattr(other, name, getattr(self, name))
        other.applied_segments = list(self.applied_segments)
        for name in _COUNTER_FIELDS:
            setattr(other, name, dict(getattr(self, name)))
        other._engine_labels = set(self._engine_labels)
        other._tool_labels = set(self._tool_labels)
        other._open_tools = dict(self._open_tools)
        other.steps = list(self.steps)
        other.restores = list(self.restores)
        other.state = self.state.copy() if state and self.state is not None else None
        other._checkpoint_times = dict(self._checkpoint_times)
        other.work = None
        return other

    def to_snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable dict of everything but the domain state (which the
        domain's own snapshot at :attr:`offset` holds): :meth:`from_snapshot` and that
        state give this projection back, value for value."""
        meta = self.last_meta
        return {
            "run_id": self.run_id,
            "offset": self.offset,
            "epoch": self.epoch,
            "started_at": _iso(self.started_at),
            "last_meta": (
                None
                if meta is None
                else [
                    meta.recorded_at.isoformat(),
                    meta.train_step,
                    meta.weight_version,
                    meta.epoch,
                ]
            ),
            "staleness_bound": self.staleness_bound,
            "train_step": self.train_step,
            "weight_version": self.weight_version,
            "published_version": self.published_version,
            "last_reward_mean": self.last_reward_mean,
            "last_checkpoint": (
                None
                if self.last_checkpoint is None
                else [self.last_checkpoint[0], self.last_checkpoint[1].isoformat()]
            ),
            "max_engine_labels": self.max_engine_labels,
            "engine_labels": sorted(self._engine_labels),
            "tool_labels": sorted(self._tool_labels),
            "open_tools": sorted(self._open_tools.items()),
            "applied_segments": [list(s) for s in self.applied_segments],
            "domain_errors": self.domain_errors,
            "last_domain_error": self.last_domain_error,
            "checkpoint_times": [[k, v.isoformat()] for k, v in self._checkpoint_times.items()],
            "steps": [r.to_dict() for r in self.steps],
            "restores": [r.to_dict() for r in self.restores],
            **_counters_to_snapshot(self),
        }

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], state: RunState) -> MetricsProjection:
        """The projection :meth:`to_snapshot` described, with the domain ``state`` at its
        offset (raises ValueError when the state is at another offset)."""
        if state.last_seq != data["offset"]:
            raise ValueError(
                f"metrics snapshot at offset {data['offset']} given a domain state at "
                f"offset {state.last_seq}"
            )
        proj = cls(max_engine_labels=int(data["max_engine_labels"]))
        proj.run_id = data["run_id"]
        proj.offset = int(data["offset"])
        proj.epoch = int(data["epoch"])
        proj.started_at = _parse_iso(data["started_at"])
        meta = data["last_meta"]
        proj.last_meta = (
            None if meta is None else EventMeta(datetime.fromisoformat(meta[0]), *meta[1:])
        )
        proj.staleness_bound = data["staleness_bound"]
        proj.train_step = data["train_step"]
        proj.weight_version = data["weight_version"]
        proj.published_version = data["published_version"]
        proj.last_reward_mean = data["last_reward_mean"]
        ckpt = data["last_checkpoint"]
        proj.last_checkpoint = None if ckpt is None else (ckpt[0], datetime.fromisoformat(ckpt[1]))
        proj._engine_labels = set(data["engine_labels"])
        proj._tool_labels = set(data.get("tool_labels", ()))
        proj._open_tools = dict(data.get("open_tools", ()))
        proj.applied_segments = [(a, b) for a, b in data["applied_segments"]]
        proj.domain_errors = data["domain_errors"]
        proj.last_domain_error = data["last_domain_error"]
        proj._checkpoint_times = {
            int(k): datetime.fromisoformat(v) for k, v in data["checkpoint_times"]
        }
        proj.steps = [
            StepRow(**{**r, "time": datetime.fromisoformat(r["time"])}) for r in data["steps"]
        ]
        proj.restores = [
            RestoreRow(**{**r, "time": datetime.fromisoformat(r["time"])}) for r in data["restores"]
        ]
        _counters_from_snapshot(proj, data)
        proj.state = state
        return proj

    def consistent_with(self, segments: Sequence[tuple[int, int]]) -> bool:
        """Whether what was applied is exactly the history ``segments`` up to :attr:`offset`.

        False once a restore has abandoned offsets this projection folded.
        """
        truncated = []
        for first, last in segments:
            if first > self.offset:
                break
            truncated.append((first, min(last, self.offset)))
        return truncated == self.applied_segments

    def _engine_label(self, engine_id: str) -> str:
        """``engine_id``, or ``other`` once ``max_engine_labels`` engines have a label."""
        if engine_id in self._engine_labels:
            return engine_id
        if len(self._engine_labels) < self.max_engine_labels and engine_id != OTHER_ENGINE:
            self._engine_labels.add(engine_id)
            return engine_id
        return OTHER_ENGINE

    def _tool_label(self, tool: str) -> str:
        """``tool``, or ``other`` once :data:`MAX_TOOL_LABELS` tools have a label."""
        if tool in self._tool_labels:
            return tool
        if len(self._tool_labels) < MAX_TOOL_LABELS and tool != OTHER_TOOL:
            self._tool_labels.add(tool)
            return tool
        return OTHER_TOOL

    # ------------------------------------------------------------------ handlers
    def _tool_requested(self, _o: int, _m: EventMeta, ev: ToolCallRequested) -> None:
        label = self._tool_label(ev.tool)
        self._open_tools[ev.idempotency_key] = label
        for outcome in TOOL_FAILURE_OUTCOMES:  # exported at 0 from the first request
            self._add("tool_failures", (label, outcome), 0)

    def _tool_answered(
        self, _o: int, _m: EventMeta, ev: ToolCallCompleted | ToolCallFailed
    ) -> None:
        label = self._open_tools.pop(ev.idempotency_key, OTHER_TOOL)
        seconds = max(0.0, ev.seconds)
        index = next(
            (i for i, b in enumerate(TOOL_SECONDS_BUCKETS) if seconds <= b),
            len(TOOL_SECONDS_BUCKETS),
        )
        self._add("tool_seconds", index)
        self._add("tool_seconds", -1, round(seconds * 1_000_000))
        if isinstance(ev, ToolCallFailed):
            self._add("tool_failures", (label, ev.outcome))

    def _trajectory_completed(self, _o: int, _m: EventMeta, ev: TrajectoryCompleted) -> None:
        self._add("trajectory_turns", ev.turns)

    # Each runs before the event is applied to the domain state (see :meth:`apply`); the
    # group lifecycle itself is the domain's ``evolve``, never re-implemented here.
    def _engine_lost(self, _o: int, _m: EventMeta, ev: EngineLost) -> None:
        self._add("engine_lost", self._engine_label(ev.engine_id))

    def _run_started(self, _o: int, _m: EventMeta, ev: RunStarted) -> None:
        self.run_id = ev.run_id
        self.staleness_bound = int(ev.rollout["staleness_bound"])

    def _pulled(self, _o: int, _m: EventMeta, _ev: GroupAdmitted | SparePulled) -> None:
        self._add("counts", "prompts_pulled")

    def _spare_assigned(self, _o: int, _m: EventMeta, ev: SpareAssigned) -> None:
        if ev.replaces_group_id is not None:
            self._add("counts", "replacements")

    def _dispatched(self, _o: int, _m: EventMeta, _ev: SiblingDispatched) -> None:
        self._add("counts", "siblings_dispatched")

    def _completed(self, _o: int, _m: EventMeta, ev: SiblingCompleted) -> None:
        # A salvaged completion was generated once, in the branch the restore abandoned:
        # the history counts it again (it is part of the new epoch), the work done not.
        work = ev.salvaged_from is None
        self._add("counts", "siblings_completed", work=work)
        self._add("counts", "tokens_generated", ev.completion_tokens, work=work)
        if ev.engine_id is not None:
            self._add("engine_completed", self._engine_label(ev.engine_id), work=work)

    def _failed(self, _o: int, _m: EventMeta, ev: SiblingFailed) -> None:
        self._add("failed", "true" if ev.retryable else "false")
        if ev.cause == "reward":
            self._add("counts", "reward_failures")

    def _aborted(self, _o: int, _m: EventMeta, _ev: SiblingAborted) -> None:
        self._add("counts", "siblings_aborted")

    def _committed(self, _o: int, _m: EventMeta, ev: GroupCommitted) -> None:
        # The tokens a group commits are those of its finished siblings (all of them,
        # once it commits); a group the state does not hold commits none.
        assert self.state is not None
        group = self.state.groups.get(ev.group_id)
        tokens = (
            sum(s.completion_tokens for s in group.siblings if s.status is SiblingStatus.DONE)
            if group is not None
            else 0
        )
        self._add("counts", "groups_committed")
        self._add("counts", "tokens_committed", tokens)

    def _dropped(self, _o: int, _m: EventMeta, ev: PromptDropped) -> None:
        self._add("dropped", ev.outcome)

    def _borrowed(self, _o: int, _m: EventMeta, _ev: GroupBorrowed) -> None:
        self._add("counts", "borrows")

    def _evicted(self, _o: int, _m: EventMeta, ev: GroupEvicted) -> None:
        bound = self.staleness_bound
        reason = "stale" if bound is not None and ev.staleness > bound else "other"
        key = (reason, "true" if ev.recovered else "false")
        self._add("evicted", key)

    def _selected(self, _o: int, _m: EventMeta, ev: GroupSelected) -> None:
        self._add("counts", "groups_selected")
        self._add("staleness_values", ev.staleness)

    def _batch_selected(self, _o: int, _m: EventMeta, ev: BatchSelected) -> None:
        self._add("counts", "shortfall", ev.shortfall)

    def _step_trained(self, offset: int, meta: EventMeta, ev: StepTrained) -> None:
        # The batch, its groups' rewards (finished siblings in sibling order) and their
        # selection staleness, from the domain state before the groups leave it.
        state = self.state
        assert state is not None
        gids = list(state.batches.get(ev.train_step, ()))
        shortfall = state.batch_shortfall.get(ev.train_step, 0)
        rewards: list[float] = []
        staleness: list[int] = []
        for gid in gids:
            group = state.groups.get(gid)
            if group is None:
                continue
            rewards.extend(
                s.reward
                for s in group.siblings
                if s.status is SiblingStatus.DONE and s.reward is not None
            )
            if group.selected_staleness is not None:
                staleness.append(group.selected_staleness)
        self._add("counts", "groups_trained", len(gids))
        self.train_step = ev.train_step + 1
        self.weight_version = ev.weight_version
        reward_mean = sum(rewards) / len(rewards) if rewards else None
        self.last_reward_mean = reward_mean
        self.steps.append(
            StepRow(
                step=ev.train_step,
                offset=offset,
                time=meta.recorded_at,
                wall_seconds=self._wall(meta),
                epoch=meta.epoch,
                weight_version=ev.weight_version,
                groups=len(gids),
                shortfall=shortfall,
                reward_mean=reward_mean,
                staleness_max=max(staleness) if staleness else None,
                staleness_mean=sum(staleness) / len(staleness) if staleness else None,
                tokens_generated=self.counts["tokens_generated"],
                tokens_committed=self.counts["tokens_committed"],
                groups_committed=self.counts["groups_committed"],
                groups_evicted=sum(self.evicted.values()),
                prompts_dropped=sum(self.dropped.values()),
            )
        )

    def _weights_published(self, _o: int, _m: EventMeta, ev: WeightsPublished) -> None:
        self.published_version = ev.weight_version

    def _checkpoint(self, offset: int, meta: EventMeta, _ev: CheckpointMarked) -> None:
        self._add("counts", "checkpoints")
        self.last_checkpoint = (offset, meta.recorded_at)
        self._checkpoint_times[offset] = meta.recorded_at

    def _run_restored(self, offset: int, meta: EventMeta, ev: RunRestored) -> None:
        # What the restore does to the groups is evolve_run_restored's business.
        self._add("counts", "restores")
        self._add("recovery_groups", "complete", ev.complete_groups_restored)
        self._add("recovery_groups", "unfinished", ev.unfinished_groups_found)
        self._add("recovery_siblings", "reused", ev.siblings_reused)
        self._add("recovery_siblings", "rerun", ev.siblings_rerun)
        self._add("recovery_siblings", "salvaged", ev.siblings_salvaged)
        ckpt_time = self._checkpoint_times.get(ev.from_offset)
        self.restores.append(
            RestoreRow(
                offset=offset,
                time=meta.recorded_at,
                wall_seconds=self._wall(meta),
                epoch=ev.epoch,
                from_offset=ev.from_offset,
                mode=ev.mode,
                granularity=ev.granularity,
                checkpoint_train_step=ev.checkpoint_train_step,
                checkpoint_weight_version=ev.checkpoint_weight_version,
                rolled_back_seconds=(
                    (meta.recorded_at - ckpt_time).total_seconds() if ckpt_time else None
                ),
                complete_groups_restored=ev.complete_groups_restored,
                unfinished_groups_found=ev.unfinished_groups_found,
                siblings_reused=ev.siblings_reused,
                siblings_rerun=ev.siblings_rerun,
                siblings_salvaged=ev.siblings_salvaged,
            )
        )

    def _run_resumed(self, _o: int, _m: EventMeta, _ev: RunResumed) -> None:
        self._add("counts", "resumes")

    def _noop(self, _o: int, _m: EventMeta, _ev: RolloutEvent) -> None:
        return None

    # ------------------------------------------------------------------ helpers
    def _wall(self, meta: EventMeta) -> float:
        assert self.started_at is not None
        return (meta.recorded_at - self.started_at).total_seconds()

    # ------------------------------------------------------------------ reading
    def gauges(self) -> dict[str, float | None]:
        """The gauge values now (the group gauges read from the domain state)."""
        in_flight = 0
        phases: dict[Phase, int] = {}
        for group in self.state.groups.values() if self.state is not None else ():
            phases[group.phase] = phases.get(group.phase, 0) + 1
            in_flight += group.count(SiblingStatus.IN_FLIGHT)  # rows, not a view each
        meta = self.last_meta
        return {
            "rollout_siblings_in_flight": in_flight,
            "rollout_groups_generating": phases.get(Phase.ADMITTED, 0),
            "rollout_buffer_groups": phases.get(Phase.READY, 0),
            "rollout_spare_groups": phases.get(Phase.SPARE, 0),
            "rollout_train_step": self.train_step,
            "rollout_weight_version": self.weight_version,
            "rollout_published_weight_version": self.published_version,
            "rollout_batch_reward_mean": self.last_reward_mean,
            "rollout_epoch": self.epoch,
            "rollout_log_offset": self.offset,
            "rollout_last_event_timestamp_seconds": (
                meta.recorded_at.timestamp() if meta is not None else None
            ),
        }

    def history_gauges(self) -> dict[str, float]:
        """The state of the run's history as gauges (see ``HISTORY_GAUGES``): these fall
        back at a restore, unlike the work-done counters."""
        out: dict[str, float] = {
            name: float(self.counts[key]) for name, key in HISTORY_GAUGES.items()
        }
        out["rollout_history_events"] = float(sum(self.events_by_type.values()))
        return out

    def families(
        self,
        since: MetricsProjection | None = None,
        *,
        work: WorkTotals | None = None,
        work_since: WorkTotals | None = None,
    ) -> list[Family]:
        """Every fold metric as exported families.

        Counters and the staleness histogram come from ``work`` (the work done by every
        stored event, see :class:`WorkTotals`) when given, else from this history's own
        counts; they count only what happened after ``since`` / ``work_since`` (earlier
        copies) when given. Gauges are the history's values now.
        """
        return projection_families(self, since, work, work_since)

    def values(
        self,
        since: MetricsProjection | None = None,
        *,
        work: WorkTotals | None = None,
        work_since: WorkTotals | None = None,
    ) -> dict[str, Any]:
        """Everything the projection knows, JSON-friendly.

        ``counters``: name -> number, or a list of ``{label: value, ..., "value": n}``:
        the work done (``work``) when given, else the history's counts;
        ``history_counters``: the same names counted over the history only;
        ``gauges``; ``histograms``: summaries (and the exact staleness distribution);
        ``steps``/``restores``: the time series; ``rates``: per second of log time.
        With ``since``, counters, histograms and series cover only what came after it.
        """
        return projection_values(self, since, work, work_since)


_SCALAR_FIELDS = (
    "run_id",
    "offset",
    "epoch",
    "started_at",
    "last_meta",
    "staleness_bound",
    "train_step",
    "weight_version",
    "published_version",
    "last_reward_mean",
    "last_checkpoint",
    "max_engine_labels",
    "domain_errors",
    "last_domain_error",
)


#: For an event the domain refused: the phase the group it names is in afterwards, as
#: the event says (None: the group leaves the state). Only this, nothing about siblings,
#: counters or cursors: enough for the group gauges to follow what the log states.
_REFUSED_PHASE: dict[type, Phase | None] = {
    SpareAssigned: Phase.ADMITTED,
    GroupCommitted: Phase.READY,
    GroupSelected: Phase.SELECTED,
    PromptDropped: None,
    GroupEvicted: None,
}


def _follow_refused(state: RunState, event: RolloutEvent) -> None:
    """After ``evolve`` refused ``event`` (a log the controller did not write): move the
    group it names to the phase it states, if the state holds that group. A fallback,
    not a second lifecycle: a log the controller wrote never gets here."""
    if type(event) not in _REFUSED_PHASE:
        return
    gid = getattr(event, "group_id", None)
    group = state.groups.get(gid) if isinstance(gid, int) else None
    if group is None:
        return
    phase = _REFUSED_PHASE[type(event)]
    if phase is None:
        del state.groups[group.group_id]
    else:
        group.phase = phase
    if phase is not Phase.SPARE and group.group_id in state.spares:
        state.spares.remove(group.group_id)
    if phase is Phase.READY:
        state.ready[group.group_id] = None
    else:
        state.ready.pop(group.group_id, None)


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _parse_iso(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text is not None else None


_Handler = Callable[[MetricsProjection, int, EventMeta, Any], None]

_HANDLERS: dict[type, _Handler] = {
    RunStarted: MetricsProjection._run_started,
    StepAdmitted: MetricsProjection._noop,
    GroupAdmitted: MetricsProjection._pulled,
    SparePulled: MetricsProjection._pulled,
    SpareAssigned: MetricsProjection._spare_assigned,
    SiblingDispatched: MetricsProjection._dispatched,
    SiblingCompleted: MetricsProjection._completed,
    SiblingFailed: MetricsProjection._failed,
    SiblingAborted: MetricsProjection._aborted,
    GroupCommitted: MetricsProjection._committed,
    PromptDropped: MetricsProjection._dropped,
    GroupBorrowed: MetricsProjection._borrowed,
    GroupEvicted: MetricsProjection._evicted,
    GroupSelected: MetricsProjection._selected,
    BatchSelected: MetricsProjection._batch_selected,
    StepTrained: MetricsProjection._step_trained,
    WeightsPublished: MetricsProjection._weights_published,
    CheckpointMarked: MetricsProjection._checkpoint,
    RunRestored: MetricsProjection._run_restored,
    RunResumed: MetricsProjection._run_resumed,
    EngineJoined: MetricsProjection._noop,
    EngineLost: MetricsProjection._engine_lost,
    ToolCallRequested: MetricsProjection._tool_requested,
    ToolCallCompleted: MetricsProjection._tool_answered,
    ToolCallFailed: MetricsProjection._tool_answered,
    TrajectoryCompleted: MetricsProjection._trajectory_completed,
    EngineRefit: MetricsProjection._noop,
}


def fold_rows(
    rows: Iterable[tuple[IndexedEvent, RolloutEvent]],
    projection: MetricsProjection | None = None,
) -> MetricsProjection:
    """Fold decoded rows (as :func:`rolloutlog.controller.rollout_controller.iter_history` yields
    them) from the beginning of a history, or onto ``projection``. The rows of a compacted
    run start after its base: fold them onto its metrics base
    (:func:`~rolloutlog.controller.metrics.retention.load_metrics_base`), or use
    :func:`project_history`."""
    proj = projection if projection is not None else MetricsProjection()
    for row, event in rows:
        proj.apply_row(row, event)
    return proj
