"""RolloutController: the pure core wired to the event store (the I/O edge).

Every command is decided against the current state, its events are submitted to the
group committer (which assigns their offsets), then applied. Nothing leaves the
controller before the events behind it are durable: :meth:`checkpoint` flushes before
returning its offset, and callers flush (:meth:`flush` / :meth:`aflush`) before handing
a batch to the trainer. Snapshots are written in the background and never stop a run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

from rolloutlog.eventstore import (
    Committer,
    EventStore,
    GroupCommitClosedError,
    PayloadNotFoundError,
    PayloadPut,
    RunInfo,
    StoredEvent,
    StoreError,
    open_committer,
)
from rolloutlog.eventstore.compaction import check_replayable

from .config import RolloutConfig, StoreConfig, fingerprint
from .domain import CODEC, decide, evolve, find_violations
from .domain.commands import (
    Command,
    CompleteSibling,
    EvictStale,
    MarkCheckpoint,
    Restore,
    Resume,
    StartRun,
)
from .domain.completion import Completion
from .domain.errors import CursorBehindError, RestoreError, UnknownPayloadError
from .domain.events import CheckpointMarked, RolloutEvent, SiblingCompleted
from .domain.invariants import check_invariants
from .domain.state import RunState
from .rollout_index import IndexedEvent, attach, encode, encode_many, read_history_indexed
from .snapshot_encoder import SnapshotEncoder, decode_snapshot, encode_snapshot

log = logging.getLogger(__name__)


class ControllerFailedError(GroupCommitClosedError):
    """The controller stopped after a failed append or apply; its ``__cause__`` is the
    original error. A :class:`GroupCommitClosedError` (a :class:`StoreError`), so code
    that handles a closed committer handles it. Open or restore the run to go on."""


SNAPSHOT_SCHEMA_VERSION = 1
Clock = Callable[[], datetime]


def run_fingerprint(rollout: RolloutConfig, dataset_fingerprint: str) -> str:
    """The fingerprint a restore compares: the rollout rules and the dataset."""
    return fingerprint({"rollout": rollout.model_dump(), "dataset": dataset_fingerprint})


@dataclass
class RecoveryReport:
    """What a restore found and did, with the time each phase took (seconds)."""

    run_id: str
    from_offset: int
    epoch: int
    mode: str
    granularity: str
    complete_groups_restored: int
    unfinished_groups_found: int
    siblings_reused: int
    siblings_rerun: int
    siblings_salvaged: int
    groups_evicted_stale: int
    snapshot_offset: int | None
    events_replayed: int
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form."""
        return asdict(self)


@dataclass
class ReplayResult:
    """A state rebuilt from the log, and how it was rebuilt."""

    state: RunState
    snapshot_offset: int | None
    events_replayed: int
    load_seconds: float
    replay_seconds: float
    #: Seconds spent after the replay waiting for the check that the events before the
    #: snapshot are all stored (it runs beside the replay; 0 when it had finished).
    log_check_seconds: float = 0.0


def iter_history(
    store: EventStore, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[tuple[IndexedEvent, RolloutEvent]]:
    """Decoded events of the run's history (skipping ranges a restore abandoned), each
    row with its rollout index keys."""
    for row in read_history_indexed(store, run_id, to_seq, from_seq=from_seq):
        yield row, CODEC.decode(row)  # type: ignore[misc]


def replay(
    store: EventStore,
    run_id: str,
    to_seq: int | None = None,
    *,
    use_snapshots: bool = True,
    check_each: Callable[[RunState, StoredEvent], None] | None = None,
    check_threads: int = 2,
) -> ReplayResult:
    """Rebuild the state at ``to_seq`` (default: the end of the current history).

    From the newest usable snapshot, the events before it are never read, so they are
    checked whole (:meth:`EventStore.check_whole`, a count over the run's primary key:
    O(log size)) while the snapshot is decoded and the tail replayed: in
    ``check_threads`` disjoint ranges, each counted on a thread of its own, in the
    database and off the GIL (``StoreConfig.log_check_threads``). Their
    :class:`CorruptLogError` is raised here, after the replay; a replay that fails first
    still waits for the checks to end, so no thread outlives the call.
    """
    if check_threads < 1:
        raise ValueError(f"check_threads must be >= 1, got {check_threads}")
    with ThreadPoolExecutor(
        max_workers=check_threads, thread_name_prefix="rolloutlog-log-check"
    ) as pool:
        checking: list[Future[None]] = []
        try:
            result = _replay(
                store, run_id, to_seq, use_snapshots, check_each, pool, checking, check_threads
            )
        except BaseException:
            # The replay's own error wins; the check is waited for (the pool's exit).
            for future in checking:
                future.cancel()
            raise
        waited = time.perf_counter()
        for future in checking:
            future.result()  # counts in the database: bounded by the log's size
        result.log_check_seconds = time.perf_counter() - waited
    return result


def check_ranges(upto: int, parts: int) -> list[tuple[int, int]]:
    """Offsets ``1..upto`` as at most ``parts`` disjoint ``(from_seq, upto)`` ranges of
    near-equal length, in order (none when ``upto`` < 1)."""
    parts = max(1, min(parts, upto))
    edges = [upto * k // parts for k in range(parts + 1)]
    return [(edges[k] + 1, edges[k + 1]) for k in range(parts) if edges[k + 1] > edges[k]]


def _replay(
    store: EventStore,
    run_id: str,
    to_seq: int | None,
    use_snapshots: bool,
    check_each: Callable[[RunState, StoredEvent], None] | None,
    pool: ThreadPoolExecutor,
    checking: list[Future[None]],
    check_threads: int,
) -> ReplayResult:
    """:func:`replay`'s work; the wholeness checks of the snapshot's events are started
    on ``pool`` and put in ``checking``."""
    started = time.perf_counter()
    segments = store.history_segments(run_id, to_seq)
    state: RunState | None = None
    snap_offset: int | None = None
    if use_snapshots:
        for first, last in reversed(segments):
            snap = store.load_snapshot(run_id, at_or_before=last, check=False)
            if snap is not None and snap.seq >= first:
                for lo, hi in check_ranges(snap.seq, check_threads):
                    checking.append(pool.submit(store.check_whole, run_id, hi, from_seq=lo))
                try:
                    state = decode_snapshot(snap.data)
                    snap_offset = snap.seq
                except Exception as exc:  # a bad snapshot costs time, never correctness
                    log.warning("ignoring unreadable snapshot at %s: %s", snap.seq, exc)
                    state = None
                break
    loaded = time.perf_counter()
    if state is None:
        state = RunState()
    # After a compaction, only offsets whose rebuild starts at or after its base work.
    check_replayable(store, run_id, segments, state.last_seq, to_seq)
    count = 0
    upper = segments[-1][1] if segments else 0
    for first, last in segments:
        lo = max(first, state.last_seq + 1)
        if lo > last:
            continue
        for row in store.read(run_id, lo, min(last, upper)):
            evolve(state, CODEC.decode(row), row.seq)  # type: ignore[arg-type]
            count += 1
            if check_each is not None:
                check_each(state, row)
    return ReplayResult(state, snap_offset, count, loaded - started, time.perf_counter() - loaded)


class RolloutController:
    """The library core: a run's state, kept in step with its log."""

    def __init__(
        self,
        store: EventStore,
        state: RunState,
        *,
        run_id: str,
        epoch: int,
        store_config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.state = state
        self.run_id = run_id
        self.epoch = epoch
        self.store_config = store_config or StoreConfig()
        self.clock: Clock = clock or (lambda: datetime.now(UTC))
        # Every append of this controller also writes its events' rollout index rows.
        attach(store)
        info = store.get_run(self.run_id)
        self.committer: Committer = open_committer(
            store,
            self.run_id,
            epoch=epoch,
            next_seq=info.last_seq + 1,
            max_batch=self.store_config.group_commit_max_batch,
            window_s=self.store_config.group_commit_window_ms / 1000,
            lock_timeout_s=self.store_config.writer_lock_timeout_s,
            writer=self.store_config.commit_writer,
            start_timeout_s=self.store_config.writer_start_timeout_s,
            reply_timeout_s=self.store_config.writer_reply_timeout_s,
        )
        self._last_snapshot = state.last_seq
        # Keeps the snapshot's group JSON current a slice at a time (snapshot_encoder.py).
        self._snapshot_encoder = SnapshotEncoder()
        self._snapshots = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutlog-snap")
        self._snapshot_future: Future[None] | None = None
        self.snapshot_failures = 0
        self.snapshots_written = 0
        #: The longest any one command spent on snapshot work (re-encoding groups and
        #: cutting the snapshot) on the caller's thread, in seconds.
        self.snapshot_step_max_s = 0.0
        self._lock = threading.RLock()
        #: Called with the (offset, event) pairs of every executed command, once they
        #: are durable (in log order; events that never became durable are never passed).
        self.listeners: list[Callable[[list[tuple[int, RolloutEvent]]], None]] = []
        self._undelivered: deque[list[tuple[int, RolloutEvent]]] = deque()
        self._deliver_lock = threading.RLock()
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def start(
        cls,
        store: EventStore,
        run_id: str,
        rollout: RolloutConfig,
        *,
        dataset_fingerprint: str,
        dataset_size: int,
        passes: int = 1,
        shuffle_seed: int | None = None,
        store_config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> RolloutController:
        """Create a new run and return its controller (epoch 1).

        The run's row and its first events (``RunStarted``) commit in one transaction: a
        crash leaves either no run (start it again) or a started run (open it).
        """
        fp = run_fingerprint(rollout, dataset_fingerprint)
        state = RunState()
        command = StartRun(
            run_id=run_id,
            rollout=rollout,
            config_fingerprint=fp,
            dataset_fingerprint=dataset_fingerprint,
            dataset_size=dataset_size,
            passes=passes,
            shuffle_seed=shuffle_seed,
        )
        events = decide(state, command)
        now = (clock or (lambda: datetime.now(UTC)))()
        rows = [
            encode(
                ev,
                recorded_at=now,
                train_step=state.train_step,
                weight_version=state.weight_version,
            )
            for ev in events
        ]
        # Apply before writing: an event the state cannot take is never made durable.
        for i, ev in enumerate(events):
            evolve(state, ev, i + 1)
        attach(store)  # the first events are indexed in the run's creating transaction
        store.create_run(
            run_id,
            config_fingerprint=fp,
            config_json=json.dumps(
                {"rollout": rollout.model_dump(), "dataset_fingerprint": dataset_fingerprint}
            ),
            first_events=rows,
        )
        return cls(store, state, run_id=run_id, epoch=1, store_config=store_config, clock=clock)

    @classmethod
    def open(
        cls,
        store: EventStore,
        run_id: str,
        *,
        store_config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> RolloutController:
        """Take over a run where it stands, in a new epoch (older writers are fenced).

        On PostgreSQL the takeover waits at most ``store_config.takeover_timeout_s`` for a
        writer that holds the run's row lock, then raises
        :class:`rolloutlog.eventstore.LockTimeoutError` naming it (the epoch is not raised).
        """
        cfg = store_config or StoreConfig()
        info = store.get_run(run_id)
        result = replay(store, run_id, check_threads=cfg.log_check_threads)
        check_invariants(result.state)
        if result.state.config is None:
            # Only an older rolloutlog could leave this (a crash between creating the run
            # and writing RunStarted): refuse before raising the epoch, so nothing changes.
            raise RestoreError(
                f"run {run_id!r} was created but never started (its log holds no RunStarted "
                "event): there is nothing to take over; start the run again under a new id"
            )
        # Decide the Resume before raising the epoch (decide is pure): a run that cannot be
        # resumed is refused without fencing anyone.
        decide(result.state, Resume(epoch=info.current_epoch + 1))
        epoch = store.open_epoch(
            run_id, expected_epoch=info.current_epoch, lock_timeout_s=cfg.takeover_timeout_s
        )
        # The new epoch continues from the log's end at open_epoch, but the writer being
        # taken over may have appended after the replay above. It is fenced now, so that
        # tail is final: fold it in, or this controller would decide from a stale state.
        for row in store.read(run_id, result.state.last_seq + 1):
            if row.epoch != info.current_epoch:
                break
            evolve(result.state, CODEC.decode(row), row.seq)  # type: ignore[arg-type]
        check_invariants(result.state)
        ctl = cls(
            store,
            result.state,
            run_id=run_id,
            epoch=epoch,
            store_config=store_config,
            clock=clock,
        )
        with ctl._abandon_on_error():
            ctl.execute(Resume(epoch=epoch))
            ctl.flush()
        return ctl

    @classmethod
    def restore(
        cls,
        store: EventStore,
        run_id: str,
        offset: int | None,
        *,
        rollout: RolloutConfig | None = None,
        dataset_fingerprint: str | None = None,
        mode: Literal["salvage", "strict"] = "salvage",
        force: bool = False,
        store_config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> tuple[RolloutController, RecoveryReport]:
        """Restore the run to the checkpoint at ``offset`` in a new epoch.

        ``rollout``/``dataset_fingerprint``: the caller's config; a fingerprint that
        differs from the run's is refused unless ``force``. ``mode="salvage"`` reuses
        completions recorded after the offset by weights the restored trainer still has.
        """
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        info = store.get_run(run_id)
        if offset is None:
            raise RestoreError(
                f"restore of run {run_id!r} needs the checkpoint offset that checkpoint() "
                "returned (stored with your model checkpoint)"
            )
        if not 1 <= offset <= info.last_seq:
            raise RestoreError(
                f"offset {offset} is outside run {run_id!r}, whose log holds 1..{info.last_seq}"
            )
        _check_fingerprint(info, rollout, dataset_fingerprint, force)
        cfg = store_config or StoreConfig()
        result = replay(store, run_id, offset, check_threads=cfg.log_check_threads)
        timings["load_snapshot"] = result.load_seconds
        timings["replay"] = result.replay_seconds
        timings["log_check"] = result.log_check_seconds
        state = result.state
        t1 = time.perf_counter()
        marker = _checkpoint_marker(store, run_id, offset) if not force else None
        if marker is None and not force:
            raise RestoreError(
                f"offset {offset} of run {run_id!r} is not a CheckpointMarked event; pass the "
                "offset checkpoint() returned, or force"
            )
        if marker is not None:
            _check_cursors(state, marker, offset)
        check_invariants(state)
        timings["check"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        salvage = _salvageable(store, run_id, offset) if mode == "salvage" else ()
        timings["salvage_scan"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        epoch = store.open_epoch(
            run_id,
            expected_epoch=info.current_epoch,
            resume_seq=offset,
            lock_timeout_s=cfg.takeover_timeout_s,
        )
        ctl = cls(store, state, run_id=run_id, epoch=epoch, store_config=store_config, clock=clock)
        with ctl._abandon_on_error():
            restored = ctl.execute(
                Restore(from_offset=offset, epoch=epoch, mode=mode, forced=force, salvage=salvage)
            )
            # A run that had failed at the checkpoint stays failed: nothing is evicted.
            evicted = (
                ctl.execute(EvictStale(reason="recovered group stale after restore"))
                if ctl.state.failure is None
                else []
            )
            ctl.flush()
        timings["append"] = time.perf_counter() - t3
        timings["total"] = time.perf_counter() - t0
        head = restored[0][1]
        report = RecoveryReport(
            run_id=run_id,
            from_offset=offset,
            epoch=epoch,
            mode=mode,
            granularity=state.rules.recovery_granularity,
            complete_groups_restored=head.complete_groups_restored,  # type: ignore[attr-defined]
            unfinished_groups_found=head.unfinished_groups_found,  # type: ignore[attr-defined]
            siblings_reused=head.siblings_reused,  # type: ignore[attr-defined]
            siblings_rerun=head.siblings_rerun,  # type: ignore[attr-defined]
            siblings_salvaged=head.siblings_salvaged,  # type: ignore[attr-defined]
            groups_evicted_stale=sum(1 for _, e in evicted if e.event_type == "GroupEvicted"),
            snapshot_offset=result.snapshot_offset,
            events_replayed=result.events_replayed,
            timings=timings,
        )
        return ctl, report

    # ------------------------------------------------------------------ commands
    def execute(
        self, command: Command, payload_puts: tuple[PayloadPut, ...] = ()
    ) -> list[tuple[int, RolloutEvent]]:
        """Decide, apply, append (group commit). Returns the (offset, event) pairs.

        The events are durable only after the next :meth:`flush`. All of a command's
        events are applied before any is queued, so an ``evolve`` error queues nothing;
        it, or a failed append, marks the controller failed: its state may be ahead of
        the log, so every later command raises :class:`ControllerFailedError`.
        Listeners see the events once they are durable (see :attr:`listeners`).
        """
        with self._lock:
            started = time.perf_counter()
            self._raise_if_failed()
            events = decide(self.state, command)
            if not events:
                return []
            if isinstance(command, CompleteSibling) and self.store_config.require_stored_payloads:
                self._check_payload(command.completion.payload_id, payload_puts)
            now = self.clock()
            ts, wv = self.state.train_step, self.state.weight_version
            rows = encode_many(events, recorded_at=now, train_step=ts, weight_version=wv)
            # Only this controller submits to its committer (under this lock), so the
            # offsets it will assign are known before anything is queued.
            first = self.committer.next_seq
            applied = [(first + i, ev) for i, ev in enumerate(events)]
            try:
                for seq, ev in applied:
                    evolve(self.state, ev, seq)
            except BaseException as exc:
                # The state is half-way through the command: nothing may follow it.
                self._mark_failed(exc)
                raise
            try:
                last = self.committer.submit(rows, payload_puts)
            except BaseException as exc:
                self._mark_failed(exc)
                raise
            if last != applied[-1][0]:  # pragma: no cover - a committer shared by mistake
                err = RuntimeError(
                    f"run {self.run_id!r}: the committer assigned offsets up to {last}, "
                    f"expected {applied[-1][0]} (another writer on this committer?)"
                )
                self._mark_failed(err)
                raise err
            self._undelivered.append(applied)
            if self.store_config.snapshot_interval > 0:
                self._snapshot_encoder.touched(events)
            self._maybe_snapshot(started)
        self._deliver_durable()
        return applied

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped this controller (a failed append or apply), if any."""
        return self._failure

    def _mark_failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
                log.error(
                    "controller of run %r failed; it accepts no more commands: %s", self.run_id, exc
                )

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ControllerFailedError(
                f"the controller of run {self.run_id!r} failed earlier and accepts no more "
                f"commands ({type(self._failure).__name__}: {self._failure}); open or restore "
                "the run from its log"
            ) from self._failure

    def _check_payload(self, payload_id: str, payload_puts: tuple[PayloadPut, ...]) -> None:
        """Refuse a completion whose payload is neither put with it nor stored."""
        if any(p.payload_id == payload_id for p in payload_puts):
            return
        for attempt in range(2):
            try:
                self.store.get_payload(self.run_id, payload_id)
                return
            except PayloadNotFoundError:
                if attempt:
                    break
                # It may have been put with an earlier command that is not durable yet.
                self.flush()
        raise UnknownPayloadError(
            f"run {self.run_id!r}: payload {payload_id!r} is not stored; pass its bytes as a "
            "PayloadPut with the command that first names it"
        )

    def _deliver_durable(self) -> None:
        """Hand listeners the events of every executed command that is now durable."""
        with self._deliver_lock:
            durable = self.committer.durable_seq
            while self._undelivered and self._undelivered[0][-1][0] <= durable:
                applied = self._undelivered.popleft()
                for listener in list(self.listeners):
                    try:
                        listener(applied)
                    except Exception:  # telemetry must never kill a run
                        log.exception("event listener failed")

    def flush(self) -> int:
        """Block until every executed command's events are durable; return that offset."""
        with self._delivering_after_flush():
            durable = self.committer.flush()
        return durable

    async def aflush(self) -> int:
        """Await durability of every executed command's events."""
        with self._delivering_after_flush():
            durable = await self.committer.aflush()
        return durable

    @contextlib.contextmanager
    def _delivering_after_flush(self) -> Iterator[None]:
        """Around a flush: a store error fails the controller; either way, hand listeners
        what became durable."""
        try:
            yield
        except StoreError as exc:
            self._mark_failed(exc)
            self._deliver_durable()
            raise
        self._deliver_durable()

    def checkpoint(self, train_step: int) -> int:
        """Mark a checkpoint after ``train_step`` trained steps; return its durable offset."""
        applied = self.execute(MarkCheckpoint(train_step=train_step))
        offset = applied[-1][0]
        self.flush()
        return offset

    def check(self) -> None:
        """Raise the first invariant violation of the live state, if any."""
        check_invariants(self.state)

    # ------------------------------------------------------------------ snapshots
    def _maybe_snapshot(self, command_started: float) -> None:
        interval = self.store_config.snapshot_interval
        if interval <= 0 or self.state.last_seq - self._last_snapshot < interval:
            return
        if self._snapshot_future is not None and not self._snapshot_future.done():
            return  # one at a time; the next is due soon enough
        seq = self.state.last_seq
        started = time.perf_counter()
        try:
            # The slice bounds the whole command: re-encoding fills what the command's own
            # work left of it (refresh still does one small batch of groups when nothing
            # is left, so a snapshot progresses behind long commands too).
            left = self.store_config.snapshot_slice_ms / 1000 - (started - command_started)
            self._snapshot_step(seq, max(0.0, left))
        finally:
            self.snapshot_step_max_s = max(self.snapshot_step_max_s, time.perf_counter() - started)

    def _snapshot_step(self, seq: int, slice_s: float) -> None:
        try:
            # Each command re-encodes at most a slice of the touched groups, so no
            # command pauses its caller for long; the snapshot is cut once all are current.
            if not self._snapshot_encoder.refresh(self.state, slice_s):
                return
            finish = self._snapshot_encoder.cut(self.state)
        except Exception:
            self.snapshot_failures += 1
            self._last_snapshot = seq
            self._snapshot_encoder = SnapshotEncoder()  # start over from a clean slate
            log.exception("encoding the snapshot at offset %s failed; the run goes on", seq)
            return
        self._last_snapshot = seq
        self._snapshot_future = self._snapshots.submit(self._write_snapshot, seq, finish)

    def _write_snapshot(self, seq: int, finish: Callable[[], bytes]) -> None:
        try:
            data = finish()  # joining and compressing: off the caller's thread
            # A snapshot may only describe durable history.
            while self.committer.durable_seq < seq:
                self.committer.flush(timeout=30)
            self.store.save_snapshot(self.run_id, seq, SNAPSHOT_SCHEMA_VERSION, data)
            self.snapshots_written += 1
        except Exception:
            self.snapshot_failures += 1
            log.exception("writing the snapshot at offset %s failed; the run goes on", seq)

    def snapshot_now(self) -> int:
        """Write a snapshot of the current state synchronously; return its offset."""
        self.flush()
        seq = self.state.last_seq
        self.store.save_snapshot(
            self.run_id, seq, SNAPSHOT_SCHEMA_VERSION, encode_snapshot(self.state)
        )
        self._last_snapshot = seq
        return seq

    @contextlib.contextmanager
    def _abandon_on_error(self) -> Iterator[None]:
        """On an error while opening, stop the commit thread (or writer process) without
        flushing and the snapshot thread, re-raise: neither may outlive a controller nobody
        can close."""
        try:
            yield
        except BaseException:
            try:
                self.committer.close(flush=False)
            finally:
                self._snapshots.shutdown(wait=False)
            raise

    def close(self) -> None:
        """Flush, finish the pending snapshot and stop the commit thread."""
        try:
            self.committer.close()
            self._deliver_durable()
        finally:
            self._snapshots.shutdown(wait=True)


def _check_fingerprint(
    info: RunInfo, rollout: RolloutConfig | None, dataset_fp: str | None, force: bool
) -> None:
    if force:
        return
    stored = json.loads(info.config_json)
    if rollout is None:
        # Without the rollout rules, the dataset alone can still be compared.
        run_dataset = stored.get("dataset_fingerprint")
        if dataset_fp is not None and dataset_fp != run_dataset:
            raise RestoreError(
                f"dataset fingerprint mismatch for run {info.run_id!r}: the run was started "
                f"with dataset {run_dataset!r}, this restore gives {dataset_fp!r}; restore "
                "with the run's own dataset, or force"
            )
        return
    expected = run_fingerprint(
        rollout, dataset_fp if dataset_fp is not None else stored["dataset_fingerprint"]
    )
    if expected != info.config_fingerprint:
        stored_rollout = stored.get("rollout", {})
        diff = sorted(
            k
            for k in set(stored_rollout) | set(rollout.model_dump())
            if stored_rollout.get(k) != rollout.model_dump().get(k)
        )
        what = f"fields that differ: {', '.join(diff)}" if diff else "the dataset differs"
        raise RestoreError(
            f"config fingerprint mismatch for run {info.run_id!r} ({what}); restore with the "
            "run's own config, or force"
        )


def _checkpoint_marker(store: EventStore, run_id: str, offset: int) -> CheckpointMarked | None:
    rows = list(store.read(run_id, offset, offset))
    if not rows or rows[0].type != CheckpointMarked.event_type:
        return None
    event = CODEC.decode(rows[0])
    assert isinstance(event, CheckpointMarked)
    return event


def _check_cursors(state: RunState, marker: CheckpointMarked, offset: int) -> None:
    """The checkpoint's recorded cursors must cover the work the log restores."""
    stamps = [g.target_step for g in state.groups.values() if g.target_step is not None]
    newest = max(stamps, default=-1)
    if marker.dispatch_cursor <= newest:
        culprit = next(g for g in state.groups.values() if g.target_step == newest)
        raise CursorBehindError(
            f"checkpoint at offset {offset}: field dispatch_cursor={marker.dispatch_cursor} is "
            f"stale, the restored buffer holds group {culprit.group_id} (prompt "
            f"{culprit.prompt_index}) stamped for step {newest}; refusing to restore rather "
            "than drop prompts",
            groups=(culprit.group_id,),
            offset=offset,
        )
    if marker.dataset_cursor < state.dataset_cursor:
        raise CursorBehindError(
            f"checkpoint at offset {offset}: field dataset_cursor={marker.dataset_cursor} is "
            f"behind the {state.dataset_cursor} prompts the restored state has pulled",
            offset=offset,
        )
    if (marker.dispatch_cursor, marker.dataset_cursor) != (
        state.dispatch_cursor,
        state.dataset_cursor,
    ):
        raise CursorBehindError(
            f"checkpoint at offset {offset} records dispatch_cursor={marker.dispatch_cursor}, "
            f"dataset_cursor={marker.dataset_cursor} but replay gives "
            f"{state.dispatch_cursor}, {state.dataset_cursor}",
            offset=offset,
        )
    violations = [v for v in find_violations(state) if isinstance(v, CursorBehindError)]
    if violations:
        raise violations[0]


def _descendant_rows(store: EventStore, run_id: str, offset: int) -> Iterator[StoredEvent]:
    """Rows recorded after ``offset`` by every branch that continues from it.

    A row continues from ``offset`` when ``offset`` lies on the history that led to the
    row: rows of the epoch that wrote ``offset`` (after it), and rows of every epoch that
    resumed at ``offset`` or continued a branch that did, including branches that later
    restores abandoned (a restore that died after opening its epoch abandons nothing of
    value). Rows of other branches were generated from another state, possibly by other
    weights under the same version number, and are left out.
    """
    epoch: int | None = None
    keep = False
    for row in store.read(run_id, offset + 1):
        if row.epoch != epoch:
            # An epoch writes one contiguous range: the history that led to its first row
            # after ``offset`` answers for all of them.
            epoch = row.epoch
            segments = store.history_segments(run_id, row.seq)
            keep = any(first <= offset <= last for first, last in segments)
        if keep:
            yield row


def _salvageable(store: EventStore, run_id: str, offset: int) -> tuple[tuple[int, Completion], ...]:
    """Completions recorded after ``offset`` by histories that continue from it, each
    with the offset of the ``SiblingCompleted`` that recorded it."""
    out = []
    for row in _descendant_rows(store, run_id, offset):
        if row.type != SiblingCompleted.event_type:
            continue
        ev = CODEC.decode(row)
        assert isinstance(ev, SiblingCompleted)
        out.append((row.seq, ev.completion()))
    return tuple(out)
