"""The log proves it is whole (issue 9, item 8).

Every read path checks that the stored offsets run exactly from the run's base to
``runs.last_seq``: a deleted row, a row beyond ``last_seq`` or a duplicated offset is
reported as :class:`CorruptLogError` naming the offset, never folded into wrong numbers
or blamed on a domain invariant. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from reliability_harness import drive, run, start

from rolloutlog.cli import main
from rolloutlog.controller.rollout_controller import RolloutController, replay
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
