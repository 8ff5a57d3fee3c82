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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rolloutlog.eventstore import EventStore, StoreError

from ..domain.events import CODEC, CheckpointMarked, RolloutEvent
from ..rollout_index import read_indexed
from .projection import METRICS, EventMeta, Family, Histogram, MetricsProjection, Sample

if TYPE_CHECKING:
    from ..rollout_controller import RecoveryReport, RolloutController
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
#: How many entries GroupCommitter drops from the front of ``commit_seconds`` when it
#: trims the list (it keeps it under 10,000 entries).
_COMMITTER_TRIM = 5_000
#: Listener batches held back waiting for an earlier one before a resync from the log.
_MAX_PENDING = 10_000

Pairs = Sequence[tuple[int, RolloutEvent]]


class MetricsSource(Protocol):
    """Anything the exporter can render: a list of metric families, read on each scrape."""

    def families(self) -> list[Family]:
        """The metric families now."""
        ...


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
    the copy plus the events since, not a recomputation of the whole history.
    """

    def __init__(self, keep_checkpoints: int = 8) -> None:
        if keep_checkpoints < 0:
            raise ValueError("keep_checkpoints must be >= 0")
        self.lock = threading.RLock()
        self.projection = MetricsProjection()
        self._copies: deque[MetricsProjection] = deque(maxlen=keep_checkpoints)
        #: Times the projection rolled back to a checkpoint copy / started over.
        self.rollbacks = 0
        self.recomputes = 0

    def apply(self, offset: int, meta: EventMeta, event: RolloutEvent) -> None:
        """Fold one event (hold :attr:`lock`)."""
        self.projection.apply(offset, meta, event)
        if isinstance(event, CheckpointMarked) and self._copies.maxlen:
            self._copies.append(self.projection.copy())

    def reset(self) -> None:
        """Start over from an empty projection (after a failed fold; hold :attr:`lock`)."""
        self.projection = MetricsProjection()
        self._copies.clear()
        self.recomputes += 1

    def realign(self, segments: Sequence[tuple[int, int]]) -> None:
        """Make the projection a prefix of the history ``segments`` (hold :attr:`lock`)."""
        if self.projection.consistent_with(segments):
            return
        for saved in reversed(self._copies):
            if saved.consistent_with(segments):
                log.info(
                    "metrics: the history changed (restore); rolling back to offset %s",
                    saved.offset,
                )
                self.projection = saved.copy()
                self.rollbacks += 1
                return
        log.info("metrics: the history changed (restore); recomputing from the start")
        self.projection = MetricsProjection()
        self.recomputes += 1

    def sync(self, store: EventStore, run_id: str, to_seq: int | None = None) -> int:
        """Fold what the log's current history holds beyond the projection (up to
        ``to_seq``), first rolling back if a restore changed the history. Returns the
        number of events folded."""
        segments = store.history_segments(run_id)
        if to_seq is not None:
            segments = [(f, min(last, to_seq)) for f, last in segments if f <= to_seq]
        with self.lock:
            self.realign(segments)
            start = self.projection.offset + 1
        folded = 0
        for first, last in segments:
            if last < start:
                continue
            chunk = []
            for row in read_indexed(store, run_id, max(first, start), last):
                chunk.append((row, CODEC.decode(row)))
                if len(chunk) >= 1000:
                    folded += self._fold(chunk)
                    chunk = []
            folded += self._fold(chunk)
        return folded

    def _fold(self, chunk: list[tuple[Any, Any]]) -> int:
        with self.lock:
            for row, event in chunk:
                if row.seq > self.projection.offset:
                    self.apply(row.seq, EventMeta.of_row(row), event)
        return len(chunk)


class _ClockTap:
    """Wraps a controller's clock to remember the metadata the controller stamps on the
    rows of the command being executed (the clock is read once per command, right
    before the rows are built from the same state), keyed by the command's first offset:
    the controller hands its events to listeners later, once they are durable."""

    def __init__(self, controller: RolloutController) -> None:
        self.controller = controller
        self.inner = controller.clock
        self._metas: dict[int, EventMeta] = {}
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        now = self.inner()
        ctl = self.controller
        state = ctl.state
        meta = EventMeta(now, state.train_step, state.weight_version, ctl.epoch)
        with self._lock:
            self._metas[ctl.committer.next_seq] = meta
            if len(self._metas) > _MAX_PENDING:  # commands that never became durable
                for stale in sorted(self._metas)[: _MAX_PENDING // 2]:
                    del self._metas[stale]
        return now

    def take(self, first_offset: int) -> EventMeta | None:
        """The metadata of the command whose events start at ``first_offset`` (once)."""
        with self._lock:
            return self._metas.pop(first_offset, None)


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
        self.runtime: Any = None
        self._tap: _ClockTap | None = None
        self._pending: dict[int, tuple[EventMeta | None, Pairs]] = {}
        self._pending_lock = threading.Lock()
        self._catching_up = False
        self._needs_sync = False
        self._needs_rebuild = False
        self._caught_up = threading.Event()
        self._append_seen = 0
        self._checkpoint_seen = 0
        self.listener_errors = 0

    @property
    def projection(self) -> MetricsProjection:
        """The projection (read it under ``follower.lock`` while a run is going)."""
        return self.follower.projection

    # ------------------------------------------------------------------ wiring
    def attach(
        self, controller: RolloutController, runtime: Any = None, *, background: bool = False
    ) -> None:
        """Follow ``controller`` (and time ``runtime``'s checkpoints when given).

        With ``background``, the catch-up from the log runs on a thread so a long history
        does not delay the run; :meth:`wait_caught_up` waits for it.
        """
        self.detach()
        self.controller = controller
        self.runtime = runtime
        self._append_seen = 0
        self._checkpoint_seen = len(getattr(runtime, "checkpoint_seconds", ()))
        self._catching_up = True
        self._caught_up.clear()
        self._tap = _ClockTap(controller)
        controller.clock = self._tap
        controller.listeners.append(self._on_events)
        if background:
            threading.Thread(
                target=self._catch_up, name="rolloutlog-metrics-catch-up", daemon=True
            ).start()
        else:
            self._catch_up(raise_errors=True)

    def attach_runtime(self, runtime: Any) -> None:
        """Time ``runtime``'s checkpoints (its ``checkpoint_seconds``)."""
        with self.follower.lock:
            self.runtime = runtime
            self._checkpoint_seen = len(getattr(runtime, "checkpoint_seconds", ()))

    def detach(self) -> None:
        """Stop following the controller (the projection keeps its values)."""
        ctl = self.controller
        if ctl is None:
            return
        if self._needs_sync:
            try:
                self.sync_now()
            except Exception:
                log.exception("metrics: recomputing from the log failed")
        with self.follower.lock:
            self._pull_timings()
        if self._on_events in ctl.listeners:
            ctl.listeners.remove(self._on_events)
        if ctl.clock is self._tap and self._tap is not None:
            ctl.clock = self._tap.inner
        self.controller = None
        self.runtime = None
        self._tap = None
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

    def _on_events(self, applied: list[tuple[int, RolloutEvent]]) -> None:
        try:
            if not applied:
                return
            meta = self._tap.take(applied[0][0]) if self._tap is not None else None
            with self._pending_lock:
                self._pending[applied[0][0]] = (meta, list(applied))
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
                if meta is None:
                    # Executed without the clock tap (attached mid-command): read it back.
                    self._needs_sync = True
                    break
                for off, event in pairs:
                    if off > self.follower.projection.offset:
                        self.follower.apply(off, meta, event)
            self._pull_timings()

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
        checkpoints = getattr(self.runtime, "checkpoint_seconds", None)
        if checkpoints is not None:
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
        """Fold metrics plus live-only timings (what the exporter renders)."""
        if self._needs_sync and not self._catching_up:
            try:
                self.sync_now()
            except StoreError:
                log.exception("metrics: recomputing from the log failed")
        with self.follower.lock:
            self._pull_timings()
            return self.follower.projection.families() + self.timings.families()

    def values(self) -> dict[str, Any]:
        """:meth:`MetricsProjection.values` plus ``live`` (the live-only timings)."""
        with self.follower.lock:
            self._pull_timings()
            return {**self.follower.projection.values(), "live": self.timings.values()}


class LogTailer:
    """Follows a run by polling its log: the source behind ``rolloutlog serve-metrics``.

    Each poll folds the history's new events; when a restore changed the history, the
    projection first rolls back to a checkpoint copy (or starts over).
    """

    def __init__(
        self, store: EventStore, run_id: str, *, interval: float = 2.0, keep_checkpoints: int = 8
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

    def poll(self) -> int:
        """Fold what is new in the log; return the number of events folded."""
        folded = self.follower.sync(self.store, self.run_id)
        self.polls += 1
        return folded

    def families(self) -> list[Family]:
        """The projection's families (no live-only timings: the log does not hold them)."""
        with self.follower.lock:
            return self.follower.projection.families()

    def start(self) -> None:
        """Poll every ``interval`` seconds on a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="rolloutlog-tail", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except StoreError as exc:  # the database may come back: keep serving
                self.errors += 1
                self.last_error = str(exc)
                log.warning("metrics: reading the log failed: %s", exc)
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass
class EmbeddedTelemetry:
    """Metrics export inside a training process: the live projection and its server."""

    live: LiveMetrics
    exporter: ExporterHandle

    @property
    def port(self) -> int:
        """The port the exporter listens on."""
        return self.exporter.port

    @property
    def url(self) -> str:
        """The scrape URL."""
        return self.exporter.url

    def close(self) -> None:
        """Stop the exporter and detach (errors are logged, never raised)."""
        try:
            self.exporter.close()
        except Exception:
            log.exception("stopping the metrics exporter failed")
        try:
            self.live.detach()
        except Exception:
            log.exception("detaching the metrics listener failed")


def start_embedded_telemetry(
    controller: RolloutController,
    runtime: Any = None,
    *,
    port: int,
    recovery: RecoveryReport | None = None,
    addr: str = "0.0.0.0",
) -> EmbeddedTelemetry | None:
    """Attach live metrics to ``controller`` and serve them on ``port``.

    Telemetry never stops a run: any failure (the port is taken, ...) is logged with
    its cause and None is returned; the run goes on without metrics export.
    """
    live = LiveMetrics()
    try:
        from .exporter import start_exporter

        live.attach(controller, runtime, background=True)
        if recovery is not None:
            live.observe_restore(recovery)
        handle = start_exporter(live, port, addr=addr)
    except Exception:
        log.exception(
            "telemetry could not start on %s:%s; the run goes on without metrics export",
            addr,
            port,
        )
        try:
            live.detach()
        except Exception:
            log.exception("detaching the metrics listener failed")
        return None
    log.info("serving rollout metrics on http://%s:%s/metrics", addr, handle.port)
    return EmbeddedTelemetry(live, handle)
