"""The log proves it is whole (issue 9, item 8).

Every read path checks that the stored offsets run exactly from the run's base to
``runs.last_seq``: a deleted row, a row beyond ``last_seq`` or a duplicated offset is
reported as :class:`CorruptLogError` naming the offset, never folded into wrong numbers
or blamed on a domain invariant. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from reliability_harness import drive, run, start, store_config

from rolloutlog.cli import main
from rolloutlog.controller.rollout_controller import RolloutController, check_ranges, replay
from rolloutlog.eventstore import CorruptLogError, EventStore, MemoryEventStore
from rolloutlog.eventstore.compaction import compact

_COLS = "run_id, seq, epoch, type, schema_version, recorded_at, payload"


@pytest.fixture
def logged(db_url: str) -> Iterator[str]:
    """A run ``r`` of three trained steps (checkpoints and snapshots on the way)."""
    store = EventStore.open(db_url)
    try:
        ctl = start(store)
        run(drive(ctl, 3))
        ctl.close()
        # Where the last snapshot falls depends on timing (a snapshot every 25 events);
        # the tests below need events after it (a tail the replay reads).
        for _ in range(3):
            if _snapshot_seqs(db_url)[-1] < store.last_seq("r"):
                break
            ctl = RolloutController.open(store, "r", store_config=store_config())
            ctl.checkpoint(ctl.state.train_step)
            ctl.close()
        assert _snapshot_seqs(db_url)[-1] < store.last_seq("r")
    finally:
        store.close()
    yield db_url


def _sql(url: str, sql: str, **params: object) -> list[tuple]:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            res = conn.execute(sa.text(sql), params)
            return [tuple(r) for r in res.fetchall()] if res.returns_rows else []
    finally:
        engine.dispose()


def _checkpoints(url: str) -> list[int]:
    rows = _sql(url, "SELECT seq FROM events WHERE run_id = 'r' AND type = 'CheckpointMarked'")
    return sorted(r[0] for r in rows)


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _assert_cli_reports(url: str, offset: int, kind: str) -> None:
    for args in (
        ("replay", url, "--run", "r", "--check"),
        ("replay", url, "--run", "r"),
        ("metrics", url, "--run", "r"),
        ("metrics", url, "--run", "r", "--json"),
        ("audit", url),
        ("audit", url, "--run", "r", "--dropped"),
    ):
        result = _cli(*args)
        assert result.exit_code != 0, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, (args, result.output)
        assert f"at offset {offset}: {kind} row" in lines[0], (args, lines[0])


def _assert_library_reports(url: str, offset: int, kind: str, *, restore_at: int) -> None:
    store = EventStore.open(url)
    try:
        calls = {
            "read": lambda: list(store.read("r")),
            "read_history": lambda: list(store.read_history("r")),
            "replay": lambda: replay(store, "r", use_snapshots=False),
            "replay_snap": lambda: replay(store, "r"),
            "check_log": lambda: store.check_log(),
            "open": lambda: RolloutController.open(store, "r"),
            "restore": lambda: RolloutController.restore(store, "r", restore_at),
        }
        for name, call in calls.items():
            with pytest.raises(CorruptLogError) as info:
                call()
            assert (info.value.offset, info.value.kind) == (offset, kind), name
            assert f"offset {offset}" in str(info.value), name
        epoch = store.get_run("r").current_epoch
        assert epoch == 1, "a refused takeover must not raise the epoch"
    finally:
        store.close()


def test_a_deleted_row_is_reported_by_every_read_path(logged: str) -> None:
    cps = _checkpoints(logged)
    # A row between two checkpoints, not itself a checkpoint.
    victim = (cps[1] + cps[2]) // 2
    assert victim not in cps
    _sql(logged, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=victim)
    _assert_library_reports(logged, victim, "missing", restore_at=cps[-1])
    _assert_cli_reports(logged, victim, "missing")


def test_a_deleted_last_row_is_reported(logged: str) -> None:
    last = _sql(logged, "SELECT last_seq FROM runs WHERE run_id = 'r'")[0][0]
    _sql(logged, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=last)
    cps = _checkpoints(logged)
    _assert_library_reports(logged, last, "missing", restore_at=cps[-1])
    _assert_cli_reports(logged, last, "missing")


def test_an_extra_row_beyond_last_seq_is_reported(logged: str) -> None:
    last = _sql(logged, "SELECT last_seq FROM runs WHERE run_id = 'r'")[0][0]
    _sql(
        logged,
        f"INSERT INTO events ({_COLS}) SELECT run_id, seq + 2, epoch, type, schema_version, "
        "recorded_at, payload "
        "FROM events WHERE run_id = 'r' AND seq = :s",
        s=last,
    )
    cps = _checkpoints(logged)
    _assert_library_reports(logged, last + 2, "extra", restore_at=cps[-2])
    _assert_cli_reports(logged, last + 2, "extra")


def test_a_partial_range_read_names_the_gap_inside_it(logged: str) -> None:
    store = EventStore.open(logged)
    try:
        _sql(logged, "DELETE FROM events WHERE run_id = 'r' AND seq = 7")
        with pytest.raises(CorruptLogError, match="offset 7: missing row"):
            list(store.read("r", 5, 9))
        with pytest.raises(CorruptLogError, match="offset 7: missing row"):
            list(store.read("r", 7, 7))
        with pytest.raises(CorruptLogError, match="offset 7: missing row"):
            store.check_log("r")
    finally:
        store.close()


def test_a_whole_log_reads_and_audits_cleanly(logged: str) -> None:
    """No false alarm: the checks pass on an intact log, through every path."""
    store = EventStore.open(logged)
    try:
        store.check_log()
        assert [r.seq for r in store.read("r")] == list(range(1, store.last_seq("r") + 1))
        replay(store, "r")
    finally:
        store.close()
    for args in (
        ("replay", logged, "--run", "r", "--check"),
        ("metrics", logged),
        ("audit", logged),
    ):
        result = _cli(*args)
        assert result.exit_code == 0, (args, result.output)


def test_after_a_compaction_the_base_is_the_compaction_point(logged: str) -> None:
    store = EventStore.open(logged)
    try:
        last = store.last_seq("r")
        # Up to a snapshot before the last event, so a row after the base exists (the
        # newest snapshot may be cut at the very last event).
        plan = compact(store, "r", last - 1)
        base = plan.snapshot_seq
        assert 1 < base < last
        store.check_log()
        assert next(iter(store.read("r"))).seq == base
        replay(store, "r")  # from the base snapshot, no false alarm
        # A row after the base goes missing: named.
        _sql(logged, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=base + 1)
        with pytest.raises(CorruptLogError, match=f"offset {base + 1}: missing row"):
            list(store.read("r"))
        with pytest.raises(CorruptLogError, match=f"offset {base + 1}: missing row"):
            store.check_log()
    finally:
        store.close()


def test_a_row_below_the_compaction_base_is_extra(logged: str) -> None:
    store = EventStore.open(logged)
    try:
        plan = compact(store, "r", store.last_seq("r"))
        base = plan.snapshot_seq
        _sql(
            logged,
            f"INSERT INTO events ({_COLS}) SELECT run_id, 1, epoch, type, schema_version, "
            "recorded_at, "
            "payload FROM events WHERE run_id = 'r' AND seq = :s",
            s=base,
        )
        with pytest.raises(CorruptLogError, match="offset 1: extra row"):
            list(store.read("r"))
        with pytest.raises(CorruptLogError, match="offset 1: extra row"):
            store.check_log()
    finally:
        store.close()


def test_memory_store_reports_duplicates_and_gaps() -> None:
    store = MemoryEventStore()
    ctl = start(store)
    ctl.close()
    events = store._runs["r"].events
    events.insert(1, events[1])  # offset 2 stored twice
    with pytest.raises(CorruptLogError) as info:
        list(store.read("r"))
    assert (info.value.offset, info.value.kind) == (2, "duplicate")
    with pytest.raises(CorruptLogError, match="offset 2: duplicate row"):
        store.check_log()
    del events[1:3]  # now offset 2 is missing
    with pytest.raises(CorruptLogError, match="offset 2: missing row"):
        list(store.read("r"))
    with pytest.raises(CorruptLogError, match="offset 2: missing row"):
        store.check_log("r")


def _snapshot_seqs(url: str) -> list[int]:
    return sorted(r[0] for r in _sql(url, "SELECT seq FROM snapshots WHERE run_id = 'r'"))


def test_a_row_before_the_snapshot_is_reported_though_the_replay_never_reads_it(
    logged: str,
) -> None:
    """The replay from a snapshot reads only the tail; the events the snapshot stands for
    are checked whole beside it (on a thread), and a gap there fails the replay."""
    snap = _snapshot_seqs(logged)[-1]
    last = _sql(logged, "SELECT last_seq FROM runs WHERE run_id = 'r'")[0][0]
    assert 2 < snap < last, "the fixture needs a snapshot with events after it"
    victim = snap // 2
    _sql(logged, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=victim)
    store = EventStore.open(logged)
    try:
        # The tail alone is whole: without the check, the replay would succeed.
        assert [r.seq for r in store.read("r", snap + 1)] == list(range(snap + 1, last + 1))
        unchecked = store.load_snapshot("r", check=False)
        assert unchecked is not None and unchecked.seq == snap
        store.check_whole("r", victim - 1)  # whole below the gap
        store.check_whole("r", snap, from_seq=victim + 1)  # and above it
        for call in (
            lambda: store.check_whole("r", snap),
            lambda: store.check_whole("r", victim, from_seq=victim),
            lambda: replay(store, "r", check_threads=1),
            lambda: store.load_snapshot("r"),
            lambda: replay(store, "r"),
        ):
            with pytest.raises(CorruptLogError) as info:
                call()
            assert (info.value.offset, info.value.kind) == (victim, "missing")
    finally:
        store.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("rolloutlog-log-check")]
    assert alive == []


class _GatedStore:
    """Delegates to a store; its ``check_whole`` waits (10 s at most) until the replay
    has started reading the tail, and records whether it had."""

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self.tail_read = threading.Event()
        self.check_saw_tail: list[bool] = []
        self.checked: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def read(self, *args: object, **kwargs: object) -> Iterator[object]:
        self.tail_read.set()
        return self._store.read(*args, **kwargs)  # type: ignore[arg-type]

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
        self.check_saw_tail.append(self.tail_read.wait(10))
        self.checked.append((from_seq, upto))
        self._store.check_whole(run_id, upto, from_seq=from_seq)


def test_the_check_runs_beside_the_tail_replay(logged: str) -> None:
    """The wholeness check does not hold up the replay (it would wait out its 10 s gate
    and record False if the replay waited for it first), and its time is reported."""
    store = EventStore.open(logged)
    try:
        gated = _GatedStore(store)
        result = replay(gated, "r", check_threads=3)  # type: ignore[arg-type]
        assert gated.check_saw_tail == [True, True, True]
        snap = _snapshot_seqs(logged)[-1]
        assert result.snapshot_offset == snap
        # Three disjoint ranges that cover 1..snap.
        assert sorted(gated.checked) == check_ranges(snap, 3)
        assert result.events_replayed == store.last_seq("r") - result.snapshot_offset
        assert result.log_check_seconds >= 0.0
    finally:
        store.close()


def test_a_failing_replay_waits_for_the_check_and_raises_its_own_error(logged: str) -> None:
    """A replay that fails (here: a store read error) raises that error, after the check
    on the thread has ended: no thread outlives the call."""
    store = EventStore.open(logged)
    ended = threading.Event()

    class _Failing(_GatedStore):
        def read(self, *args: object, **kwargs: object) -> Iterator[object]:
            self.tail_read.set()
            raise RuntimeError("read failed")

        def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
            super().check_whole(run_id, upto, from_seq=from_seq)
            time.sleep(0.2)  # still running when the replay has failed
            ended.set()

    try:
        with pytest.raises(RuntimeError, match="read failed"):
            replay(_Failing(store), "r")  # type: ignore[arg-type]
        assert ended.is_set()
    finally:
        store.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("rolloutlog-log-check")]
    assert alive == []


def test_restore_reports_the_log_check_phase(logged: str) -> None:
    store = EventStore.open(logged)
    try:
        ctl, report = RolloutController.restore(store, "r", _checkpoints(logged)[-1])
        ctl.close()
        assert report.snapshot_offset is not None
        assert report.timings["log_check"] >= 0.0
        assert {"load_snapshot", "replay", "log_check", "check", "total"} <= set(report.timings)
    finally:
        store.close()


def test_memory_store_checks_whole_up_to_an_offset() -> None:
    store = MemoryEventStore()
    ctl = start(store)
    run(drive(ctl, 1))
    ctl.close()
    last = store.last_seq("r")
    events = store._runs["r"].events
    del events[4]  # offset 5 is missing
    store.check_whole("r", 4)
    store.check_whole("ghost", 10)  # an unknown run is not checked
    with pytest.raises(CorruptLogError, match="offset 5: missing row"):
        store.check_whole("r", 5)
    with pytest.raises(CorruptLogError, match="offset 5: missing row"):
        store.check_whole("r", last + 10)
    store.check_whole("r", last, from_seq=6)
    with pytest.raises(CorruptLogError, match="offset 5: missing row"):
        store.check_whole("r", 5, from_seq=5)
    events.insert(5, events[5])  # offset 7 stored twice
    with pytest.raises(CorruptLogError, match="offset 7: duplicate row"):
        store.check_whole("r", last, from_seq=6)


@pytest.mark.parametrize(("upto", "parts"), [(0, 2), (1, 2), (5, 1), (5, 2), (7, 3), (10, 4)])
def test_check_ranges_split_the_offsets_evenly(upto: int, parts: int) -> None:
    ranges = check_ranges(upto, parts)
    covered = [seq for lo, hi in ranges for seq in range(lo, hi + 1)]
    assert covered == list(range(1, upto + 1))
    assert len(ranges) == min(parts, upto)
    sizes = [hi - lo + 1 for lo, hi in ranges]
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_replay_refuses_no_check_threads() -> None:
    with pytest.raises(ValueError, match="check_threads must be >= 1"):
        replay(MemoryEventStore(), "r", check_threads=0)
