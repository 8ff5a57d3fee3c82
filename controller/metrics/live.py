"""Keeping a :class:`MetricsProjection` current: live beside a controller, or by tailing
the log from another process.

Both paths feed the same fold with the same inputs. A :class:`ProjectionFollower` owns
the projection and knows how to bring it in line with the log's *current history*: when
a restore abandons offsets the projection has folded, it rolls back to a copy taken at a
checkpoint that is still part of the history (or recomputes from the start) and folds
the rest from the log. :class:`LiveMetrics` feeds it from a controller's listeners
(catching up from the log for events written before it attached, e.g. the restore's own
events); :class:`LogTailer` feeds it by polling the log (``rolloutlog serve-metrics``).

Telemetry never stops a run: listener errors are logged and the projection is
recomputed from the log on the next read, never raised into the controller.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutlog.eventstore import EventStoreProtocol, StoreError
from rolloutlog.eventstore.committer import COMMIT_HISTORY
from rolloutlog.eventstore.watch import AppendWatcher

from ..domain.events import CODEC, CheckpointMarked, RolloutEvent
from ..domain.state import RunState
from ..recorded import RecordedEvents
from ..rollout_index import read_indexed
from .catalog import METRICS
from .exposition import Family, Sample
from .fold import EventMeta, MetricsProjection, WorkTotals
from .histogram import Histogram
from .retention import load_metrics_base
from .steps import StepPublisher, StepSink

if TYPE_CHECKING:
    from ..rollout_controller import RecoveryReport, RolloutController
    from ..rollout_runtime import RolloutRuntime
    from .exporter import ExporterHandle

log = logging.getLogger(__name__)

#: Buckets of ``rollout_log_append_seconds``.
APPEND_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
#: Buckets of ``rollout_checkpoint_seconds``.
CHECKPOINT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: How many entries a committer drops from the front of ``commit_seconds`` when it
#: trims the list (see groupcommit.record_commit_seconds).
_COMMITTER_TRIM = COMMIT_HISTORY // 2
#: Listener batches held back waiting for an earlier one before a resync from the log.
_MAX_PENDING = 10_000

Pairs = Sequence[tuple[int, RolloutEvent]]


class LiveTimings:
    """Timings the log does not record: append latency, checkpoint and restore durations."""

    def __init__(self) -> None:
        self.append = Histogram(APPEND_BUCKETS)
        self.checkpoint = Histogram(CHECKPOINT_BUCKETS)
        self.restore_phases: dict[str, float] = {}

    def families(self) -> list[Family]:
        """The live-only families."""
        out = [
            Family(
                "rollout_log_append_seconds",
                METRICS["rollout_log_append_seconds"],
                (Sample({}, self.append.copy()),),
            ),
            Family(
                "rollout_checkpoint_seconds",
                METRICS["rollout_checkpoint_seconds"],
                (Sample({}, self.checkpoint.copy()),),
            ),
        ]
        if self.restore_phases:
            out.append(
                Family(
                    "rollout_restore_phase_seconds",
                    METRICS["rollout_restore_phase_seconds"],
                    tuple(
                        Sample({"phase": phase}, seconds)
                        for phase, seconds in sorted(self.restore_phases.items())
                    ),
                )
            )
        return out

    def values(self) -> dict[str, Any]:
        """JSON-friendly summaries."""
        return {
            "rollout_log_append_seconds": self.append.summary(),
            "rollout_checkpoint_seconds": self.checkpoint.summary(),
            "rollout_restore_phase_seconds": dict(self.restore_phases),
        }


class ProjectionFollower:
    """A projection kept equal to the fold of a run's current history.

    Copies of the projection are kept at the newest ``keep_checkpoints`` checkpoint
    markers, so a restore (which always goes back to a checkpoint) costs a rollback to
    the copy plus the events since, not a recomputation of the whole history. The copies
    leave out the projection's domain state (copying it at every checkpoint would cost
    the run's process seconds for a large buffer); a rollback rebuilds it with the
    domain's replay (the nearest snapshot, then the events since), as a restore does.

    The first :meth:`sync` of a compacted run starts from its metrics base (see
    :mod:`rolloutlog.controller.metrics.retention`), and so does a recomputation.
    """

    def __init__(self, keep_checkpoints: int = 8) -> None:
        if keep_checkpoints < 0:
            raise ValueError("keep_checkpoints must be >= 0")
        self.lock = threading.RLock()
        #: The work done by every event folded, all branches (never rolled back).
        self.work = WorkTotals()
        self.projection = MetricsProjection()
        self.projection.work = self.work
        self._copies: deque[MetricsProjection] = deque(maxlen=keep_checkpoints)
        #: Whether the projection was started (from the metrics base of a compacted
        #: run, see :meth:`sync`).
        self._started = False
        #: Times the projection rolled back to a checkpoint copy / started over.
        self.rollbacks = 0
        self.recomputes = 0

    def apply(self, offset: int, meta: EventMeta, event: RolloutEvent) -> None:
        """Fold one event of the projection's own branch (hold :attr:`lock`)."""
        self.projection.apply(offset, meta, event)
        if isinstance(event, CheckpointMarked) and self._copies.maxlen:
            self._copies.append(self.projection.copy(state=False))

    def reset(self) -> None:
        """Start over from nothing (after a failed fold; hold :attr:`lock`)."""
        self.work = WorkTotals()
        self.projection = MetricsProjection()
        self.projection.work = self.work
        self._copies.clear()
        self._started = False
        self.recomputes += 1

    def _start(self, store: EventStoreProtocol, run_id: str) -> None:
        """Before the first event: start from the run's metrics base if it was
        compacted (the events before it are gone); hold :attr:`lock`."""
        self._started = True
        base = load_metrics_base(store, run_id)
        if base is None:
            return
        projection, work = base.start()
        projection.work = work
        self.projection, self.work = projection, work

    @staticmethod
    def _restart(store: EventStoreProtocol, run_id: str) -> MetricsProjection:
        """A projection at the start of the run's history: empty, or the metrics base of
        a compacted run (its work totals are not used: work is never rolled back)."""
        base = load_metrics_base(store, run_id)
        return MetricsProjection() if base is None else base.start()[0]

    @staticmethod
    def _domain_state_at(store: EventStoreProtocol, run_id: str, offset: int) -> RunState | None:
        """The domain state of the history leading to ``offset``, rebuilt by the domain's
        replay; None (logged) when it cannot be."""
        from ..rollout_history import replay

        try:
            state = replay(store, run_id, offset).state
        except Exception:
            log.exception("metrics: rebuilding the domain state at offset %s failed", offset)
            return None
        return state if state.last_seq == offset else None

    def _switch_branch(self, store: EventStoreProtocol, run_id: str, seq: int) -> None:
        """Make the projection the history that leads to the event at ``seq`` (the first
        event of a new epoch), minus that event (hold :attr:`lock`).

        A restore's epoch continues the history from an older checkpoint: roll back to a
        copy at that checkpoint (or start over) and fold the rest of the prefix again,
        without counting it as work (every event before ``seq`` is already counted).
        """
        segments = store.history_segments(run_id, seq)
        prefix = [(first, min(last, seq - 1)) for first, last in segments if first < seq]
        if self.projection.applied_segments == prefix:
            return  # a takeover where the run stood: the same branch goes on
        base: MetricsProjection | None = None
        for saved in reversed(self._copies):
            if saved.consistent_with(prefix):
                state = self._domain_state_at(store, run_id, saved.offset)
                if state is None:
                    break
                log.info(
                    "metrics: the history changed (restore); rolling back to offset %s",
                    saved.offset,
                )
                base = saved.copy(state=False)
                base.state = state
                self.rollbacks += 1
                break
        if base is None:
            log.info("metrics: the history changed (restore); recomputing from the start")
            base = self._restart(store, run_id)
            self.recomputes += 1
        for first, last in prefix:
            if last <= base.offset:
                continue
            for row in read_indexed(store, run_id, max(first, base.offset + 1), last):
                base.apply_row(row)
        base.work = self.work
        self.projection = base

    def sync(self, store: EventStoreProtocol, run_id: str, to_seq: int | None = None) -> int:
        """Fold every stored event of the run beyond the projection (up to ``to_seq``),
        in offset order, all epochs: each counts once in :attr:`work`, and at each new
        epoch the projection switches to that epoch's history first (a rollback when a
        restore abandoned a branch). Returns the number of events folded."""
        last = store.last_seq(run_id)
        if to_seq is not None:
            last = min(last, to_seq)
        with self.lock:
            if not self._started and self.projection.offset == 0:
                self._start(store, run_id)
            start = self.projection.offset + 1
        folded = 0
        if start > last:
            return 0
        chunk = []
        for row in read_indexed(store, run_id, start, last):
            chunk.append((row, CODEC.decode(row)))
            if len(chunk) >= 1000:
                folded += self._fold(store, run_id, chunk)
                chunk = []
        folded += self._fold(store, run_id, chunk)
        return folded

    def _fold(self, store: EventStoreProtocol, run_id: str, chunk: list[tuple[Any, Any]]) -> int:
        with self.lock:
            for row, event in chunk:
                if row.seq <= self.projection.offset:
                    continue
                if row.epoch != self.projection.epoch:
                    self._switch_branch(store, run_id, row.seq)
                self.apply(row.seq, EventMeta.of_row(row), event)
        return len(chunk)


class LiveMetrics:
    """The metrics projection of a run, fed live by a controller's listener.

    ``attach(controller)`` first catches up from the log (everything the controller
    applied before, e.g. RunStarted or a restore's events), then folds each executed
    command's events with the same metadata the log stores for them. After a restore,
    ``attach`` the new controller: the projection rolls back to the checkpoint and goes
    on. Also collects the live-only timings (append latency from the controller's group
    committer, checkpoint durations from the runtime, restore phases from
    :meth:`observe_restore`).
    """

    def __init__(self, *, keep_checkpoints: int = 8) -> None:
        self.follower = ProjectionFollower(keep_checkpoints)
        self.timings = LiveTimings()
        self.controller: RolloutController | None = None
        self.runtime: RolloutRuntime | None = None
        self._pending: dict[int, tuple[EventMeta, Pairs]] = {}
        self._pending_lock = threading.Lock()
        self._catching_up = False
        self._needs_sync = False
        self._needs_rebuild = False
        self._caught_up = threading.Event()
        self._append_seen = 0
        self._checkpoint_seen = 0
        self.listener_errors = 0
        self._publishers: list[StepPublisher] = []

    @property
    def projection(self) -> MetricsProjection:
        """The projection (read it under ``follower.lock`` while a run is going)."""
        return self.follower.projection

    @property
    def run_id(self) -> str | None:
        """The run followed (None before its first event is folded)."""
        if self.controller is not None:
            return self.controller.run_id
        return self.follower.projection.run_id

    @property
    def has_step_sinks(self) -> bool:
        """Whether a per-step sink (:meth:`add_step_sink`) is attached and not closed."""
        return bool(self._publishers)

    # ------------------------------------------------------------------ wiring
    def add_step_sink(self, sink: StepSink, written: Mapping[int, float] | None = None) -> None:
        """Hand every trained step of the history to ``sink`` (TensorBoard, W&B, ...) as
        it is folded; ``written``: step -> offset of what the sink already holds (a
        :class:`~rolloutlog.controller.metrics.steps.TensorBoardSink` reads its directory back)."""
        with self.follower.lock:
            self._publishers.append(StepPublisher(sink, written))
            self._publish()

    def _publish(self) -> None:
        """Write new steps to the sinks (hold ``follower.lock``); errors are logged."""
        for publisher in self._publishers:
            try:
                publisher.publish(self.follower.projection)
            except Exception:
                log.exception("metrics: writing per-step scalars failed")

    def close_step_sinks(self) -> None:
        """Write what is left, then close every step sink (errors are logged)."""
        with self.follower.lock:
            self._publish()
            for publisher in self._publishers:
                try:
                    publisher.sink.close()
                except Exception:
                    log.exception("metrics: closing a step sink failed")
            self._publishers = []

    def attach(
        self,
        controller: RolloutController,
        runtime: RolloutRuntime | None = None,
        *,
        background: bool = False,
    ) -> None:
        """Follow ``controller`` (and time ``runtime``'s checkpoints when given).

        With ``background``, the catch-up from the log runs on a thread so a long history
        does not delay the run; :meth:`wait_caught_up` waits for it.
        """
        self.detach()
        self.controller = controller
        self.runtime = runtime
        self._append_seen = 0
        self._checkpoint_seen = 0 if runtime is None else len(runtime.checkpoint_seconds)
        self._catching_up = True
        self._caught_up.clear()
        controller.listeners.append(self._on_events)
        if background:
            threading.Thread(
                target=self._catch_up, name="rolloutlog-metrics-catch-up", daemon=True
            ).start()
        else:
            self._catch_up(raise_errors=True)

    def _sync_logging(self, errors: type[Exception]) -> None:
        """:meth:`sync_now`, logging a failure of type ``errors`` instead of raising it."""
        try:
            self.sync_now()
        except errors:
            log.exception("metrics: recomputing from the log failed")

    def detach(self) -> None:
        """Stop following the controller (the projection keeps its values)."""
        ctl = self.controller
        if ctl is None:
            return
        if self._needs_sync:
            self._sync_logging(Exception)
        with self.follower.lock:
            self._pull_timings()
        if self._on_events in ctl.listeners:
            ctl.listeners.remove(self._on_events)
        self.controller = None
        self.runtime = None
        with self._pending_lock:
            self._pending.clear()

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Wait until the catch-up of the last :meth:`attach` is done."""
        return self._caught_up.wait(timeout)

    def observe_restore(self, report: RecoveryReport) -> None:
        """Record the phase timings of a restore (the log does not hold them)."""
        with self.follower.lock:
            self.timings.restore_phases = dict(report.timings)

    # ------------------------------------------------------------------ feeding
    def _catch_up(self, *, raise_errors: bool = False) -> None:
        ctl = self.controller
        try:
            if ctl is not None:
                durable = ctl.flush()
                self.follower.sync(ctl.store, ctl.run_id, to_seq=durable)
        except Exception as exc:
            if raise_errors:
                raise
            log.exception("metrics: catching up from the log failed; retrying on the next read")
            self._needs_rebuild = not isinstance(exc, StoreError)  # a fold error: start over
            self._needs_sync = True
        finally:
            self._catching_up = False
            self._caught_up.set()
        self._drain()

    def _on_events(self, recorded: RecordedEvents) -> None:
        try:
            if not recorded.events:
                return
            meta = EventMeta(
                recorded.recorded_at, recorded.train_step, recorded.weight_version, recorded.epoch
            )
            with self._pending_lock:
                self._pending[recorded.first_offset] = (meta, list(recorded.pairs()))
                overflow = len(self._pending) > _MAX_PENDING
            if overflow:
                log.warning("metrics: events arrive with a gap; recomputing from the log")
                with self._pending_lock:
                    self._pending.clear()
                self._needs_sync = True
                return
            if not self._catching_up:
                self._drain()
        except Exception:
            # The fold may have stopped halfway through an event: start over from the log.
            self.listener_errors += 1
            self._needs_rebuild = True
            self._needs_sync = True
            log.exception("metrics listener failed; the metrics will be recomputed from the log")

    def _drain(self) -> None:
        with self.follower.lock:
            while True:
                with self._pending_lock:
                    if not self._pending:
                        break
                    first = min(self._pending)
                    meta, pairs = self._pending[first]
                    offset = self.follower.projection.offset
                    if pairs[-1][0] <= offset:
                        del self._pending[first]
                        continue
                    if first > offset + 1:
                        break  # an earlier command's events have not arrived yet
                    del self._pending[first]
                if meta.epoch != self.follower.projection.epoch:
                    # A new epoch the projection has not switched to: read it back from
                    # the log.
                    self._needs_sync = True
                    break
                for off, event in pairs:
                    if off > self.follower.projection.offset:
                        self.follower.apply(off, meta, event)
            self._pull_timings()
            if self._publishers:
                self._publish()

    def _pull_timings(self) -> None:
        """Copy new append and checkpoint durations (hold ``follower.lock``)."""
        ctl = self.controller
        if ctl is not None:
            seconds = ctl.committer.commit_seconds
            n = len(seconds)
            if n < self._append_seen:  # the committer trimmed its list
                self._append_seen = max(0, self._append_seen - _COMMITTER_TRIM)
            for value in seconds[self._append_seen : n]:
                self.timings.append.observe(value)
            self._append_seen = n
        if self.runtime is not None:
            checkpoints = self.runtime.checkpoint_seconds
            if len(checkpoints) < self._checkpoint_seen:
                self._checkpoint_seen = 0
            for value in checkpoints[self._checkpoint_seen :]:
                self.timings.checkpoint.observe(value)
            self._checkpoint_seen = len(checkpoints)

    def sync_now(self) -> None:
        """Fold whatever the log holds that the projection missed (after a listener error
        or a gap), then what is pending."""
        ctl = self.controller
        if ctl is None:
            return
        self._needs_sync = False
        if self._needs_rebuild:
            with self.follower.lock:
                self._needs_rebuild = False
                self.follower.reset()
        self.follower.sync(ctl.store, ctl.run_id, to_seq=ctl.committer.durable_seq)
        self._drain()
        with self._pending_lock:
            if self._pending:  # still a gap: look again on the next read
                self._needs_sync = True

    # ------------------------------------------------------------------ reading
    def families(self) -> list[Family]:
        """Fold metrics plus live-only timings (what the exporter renders).

        Until the catch-up from the log is done, only the timings: a new process serving
        a resumed run would otherwise show its counters climbing from 0 while it folds
        the log, which Prometheus reads as a reset of the previous process's values."""
        if not self._caught_up.is_set():
            with self.follower.lock:
                return self.timings.families()
        if self._needs_sync and not self._catching_up:
            self._sync_logging(StoreError)
        with self.follower.lock:
            self._pull_timings()
            follower = self.follower
            return follower.projection.families(work=follower.work) + self.timings.families()

    def values(self) -> dict[str, Any]:
        """:meth:`MetricsProjection.values` plus ``live`` (the live-only timings)."""
        with self.follower.lock:
            self._pull_timings()
            values = self.follower.projection.values(work=self.follower.work)
            return {**values, "live": self.timings.values()}


class _LogFollower:
    """Polls ``self.poll()`` on a daemon thread: on PostgreSQL it wakes on every append
    (LISTEN, see :class:`AppendWatcher`), at the latest every ``interval`` seconds; on
    SQLite it polls every ``interval``. Read errors are counted and logged, never fatal."""

    store: EventStoreProtocol
    interval: float
    errors: int
    last_error: str | None
    _stop: threading.Event
    _thread: threading.Thread | None
    _watcher: AppendWatcher | None

    def poll(self) -> int:
        """Fold what is new in the log (the subclass's job)."""
        raise NotImplementedError

    def start(self) -> None:
        """Follow the log on a daemon thread."""
        self._watcher = AppendWatcher(self.store, stop=self._stop)
        self._thread = threading.Thread(target=self._loop, name="rolloutlog-tail", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        watcher = self._watcher
        assert watcher is not None
        try:
            while not self._stop.is_set():
                try:
                    self.poll()
                except StoreError as exc:  # the database may come back: keep serving
                    self.errors += 1
                    self.last_error = str(exc)
                    log.warning("metrics: reading the log failed: %s", exc)
                try:
                    watcher.wait(self.interval)
                except StoreError as exc:  # no more notifications: poll from now on
                    log.warning("metrics: %s; polling every %ss instead", exc, self.interval)
        finally:
            watcher.close()  # its connection is this thread's alone

    def close(self) -> None:
        """Stop following the log (within one ``interval``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class LogTailer(_LogFollower):
    """Follows a run by polling its log: the source behind ``rolloutlog serve-metrics``.

    Each poll folds the history's new events; when a restore changed the history, the
    projection first rolls back to a checkpoint copy (or starts over).
    """

    def __init__(
        self,
        store: EventStoreProtocol,
        run_id: str,
        *,
        interval: float = 2.0,
        keep_checkpoints: int = 8,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0 seconds")
        self.store = store
        self.run_id = run_id
        self.interval = interval
        self.follower = ProjectionFollower(keep_checkpoints)
        self.polls = 0
        self.errors = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: AppendWatcher | None = None

    def poll(self) -> int:
        """Fold what is new in the log; return the number of events folded."""
        folded = self.follower.sync(self.store, self.run_id)
        self.polls += 1
        return folded

    def families(self) -> list[Family]:
        """The projection's families (no live-only timings: the log does not hold them)."""
        with self.follower.lock:
            return self.follower.projection.families(work=self.follower.work)


class RunsTailer(_LogFollower):
    """Follows several runs of one log, each with its own :class:`LogTailer`: the given
    ``run_ids``, or (without them) every run, the newest ``max_runs``, runs created
    later included (``rolloutlog serve-metrics --all-runs``)."""

    def __init__(
        self,
        store: EventStoreProtocol,
        run_ids: Sequence[str] = (),
        *,
        interval: float = 2.0,
        max_runs: int = 20,
        keep_checkpoints: int = 8,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0 seconds")
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.store = store
        self.fixed = list(run_ids)
        self.interval = interval
        self.max_runs = max_runs
        self.keep_checkpoints = keep_checkpoints
        self.tailers: dict[str, LogTailer] = {}
        self.errors = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: AppendWatcher | None = None

    def discover(self) -> list[str]:
        """The runs served now (adding new runs, dropping those beyond ``max_runs``)."""
        names = self.fixed or [r.run_id for r in self.store.list_runs()][-self.max_runs :]
        with self._lock:
            for name in names:
                if name not in self.tailers:
                    self.tailers[name] = LogTailer(
                        self.store,
                        name,
                        interval=self.interval,
                        keep_checkpoints=self.keep_checkpoints,
                    )
            for name in [n for n in self.tailers if n not in names]:
                del self.tailers[name]
        return list(names)

    def poll(self) -> int:
        """Discover runs, then fold what is new in each; the number of events folded."""
        self.discover()
        return sum(t.poll() for t in self.sources())

    def sources(self) -> list[LogTailer]:
        """One tailer per run served (what the exporter renders)."""
        with self._lock:
            return list(self.tailers.values())


@dataclass
class EmbeddedTelemetry:
    """Telemetry inside a training process: the live projection, its Prometheus server
    (None when only per-step sinks were asked for) and its per-step sinks."""

    live: LiveMetrics
    exporter: ExporterHandle | None

    @property
    def port(self) -> int | None:
        """The port the exporter listens on."""
        return self.exporter.port if self.exporter is not None else None

    @property
    def url(self) -> str | None:
        """The scrape URL."""
        return self.exporter.url if self.exporter is not None else None

    def close(self) -> None:
        """Stop the exporter, close the step sinks and detach (errors are logged)."""
        try:
            if self.exporter is not None:
                self.exporter.close()
        except Exception:
            log.exception("stopping the metrics exporter failed")
        try:
            self.live.close_step_sinks()
        except Exception:
            log.exception("closing the per-step sinks failed")
        try:
            self.live.detach()
        except Exception:
            log.exception("detaching the metrics listener failed")


def start_embedded_telemetry(
    controller: RolloutController,
    runtime: RolloutRuntime | None = None,
    *,
    port: int,
    recovery: RecoveryReport | None = None,
    addr: str = "127.0.0.1",
    serve: bool = True,
    tensorboard_dir: Path | None = None,
    step_sinks: Sequence[StepSink] = (),
) -> EmbeddedTelemetry | None:
    """Attach live metrics to ``controller``; serve them on ``addr:port`` (``serve``),
    write per-step scalars to TensorBoard under ``tensorboard_dir`` and to any other
    ``step_sinks``.

    Telemetry never stops a run, and one part failing leaves the others on: a port that
    is taken, or TensorBoard without tensorboardX, is logged as one line naming the cause
    and the run goes on with the rest (None when nothing is left to do); an unexpected
    failure is logged with its traceback.
    """
    live = LiveMetrics()
    handle: ExporterHandle | None = None
    if tensorboard_dir is not None:
        from .steps import TensorBoardSink, TensorBoardUnavailableError

        try:
            board = TensorBoardSink(tensorboard_dir)
            live.add_step_sink(board, board.written_offsets())
        except (TensorBoardUnavailableError, OSError) as exc:
            log.error("TensorBoard files are not written to %s: %s", tensorboard_dir, exc)
    try:
        for sink in step_sinks:
            live.add_step_sink(sink)
        if live.has_step_sinks or serve:
            live.attach(controller, runtime, background=True)
            if recovery is not None:
                live.observe_restore(recovery)
        if serve:
            from .exporter import start_exporter

            try:
                handle = start_exporter(live, port, addr=addr)
            except OSError as exc:
                log.error(
                    "the metrics exporter cannot listen on %s:%s (%s); the run goes on "
                    "without it%s",
                    addr,
                    port,
                    exc.strerror or exc,
                    "; the per-step sinks (TensorBoard) keep writing"
                    if live.has_step_sinks
                    else "",
                )
    except Exception:
        log.exception(
            "telemetry could not start on %s:%s; the run goes on without metrics export",
            addr,
            port,
        )
        handle = None
        try:
            live.close_step_sinks()
            live.detach()
        except Exception:
            log.exception("detaching the metrics listener failed")
        return None
    if handle is None and not live.has_step_sinks:
        live.detach()
        return None
    if handle is not None:
        log.info("serving rollout metrics of run %s at %s", controller.run_id, handle.url)
    return EmbeddedTelemetry(live, handle)
