"""A row missing from a branch that a restore abandoned is reported (issue 31, item 7).

The readers of the current history (replay, ``open``, ``restore``, ``replay --check`` and
``--verify-decisions``) skip the rows of abandoned branches; they must still find a row
missing there, as ``metrics`` and ``audit`` (which read every row) do, and name its
offset with :class:`CorruptLogError`. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from reliability_harness import drive, run, start

from rolloutlog.cli import main
from rolloutlog.controller.replay_tool import check_history, verify_decisions
from rolloutlog.controller.rollout_controller import RolloutController, check_ranges, replay
from rolloutlog.controller.rollout_index import read_history_indexed
from rolloutlog.eventstore import CorruptLogError, EventStore, MemoryEventStore


@dataclass(frozen=True)
class Branched:
    url: str
    resumed_at: int  # the checkpoint the restore went back to
    first_seq: int  # the restore's epoch's first offset (the abandoned rows end before it)
    checkpoints: list[int]  # of the current history, oldest first


def _sql(url: str, sql: str, **params: object) -> list[tuple]:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            res = conn.execute(sa.text(sql), params)
            return [tuple(r) for r in res.fetchall()] if res.returns_rows else []
    finally:
        engine.dispose()


def _branch(store: EventStore | MemoryEventStore) -> tuple[int, int, list[int]]:
    """Three trained steps (snapshots every 25 events), then a restore to the checkpoint
    of step 1 that trains to step 3 again (no snapshots: the default interval), so the
    newest snapshot of the current history lies before the abandoned rows."""
    ctl = start(store)
    run(drive(ctl, 3))
    ctl.close()
    cps = [r.seq for r in store.read("r") if r.type == "CheckpointMarked"]
    resumed_at = cps[2]  # step 0's checkpoint, then step 1's
    ctl, _ = RolloutController.restore(store, "r", resumed_at)
    run(drive(ctl, 3))
    ctl.close()
    history = [r.seq for r in store.read_history("r") if r.type == "CheckpointMarked"]
    first_seq = next(r.seq for r in store.read("r") if r.epoch == 2)
    assert resumed_at + 10 < first_seq, "the fixture needs an abandoned branch"
    return resumed_at, first_seq, history


@pytest.fixture
def branched(db_url: str) -> Iterator[Branched]:
    store = EventStore.open(db_url)
    try:
        resumed_at, first_seq, history = _branch(store)
    finally:
        store.close()
    yield Branched(db_url, resumed_at, first_seq, history)


def _cli(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()]


def test_a_row_missing_from_an_abandoned_branch_is_reported_by_every_path(
    branched: Branched,
) -> None:
    url, victim = branched.url, (branched.resumed_at + branched.first_seq) // 2
    _sql(url, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=victim)
    store = EventStore.open(url)
    try:
        snaps = [r[0] for r in _sql(url, "SELECT seq FROM snapshots WHERE run_id = 'r'")]
        assert max(s for s in snaps if s <= branched.resumed_at or s >= branched.first_seq) < (
            victim
        ), "no snapshot of the current history may stand for the victim (it would count it)"
        newest = branched.checkpoints[-1]
        calls = {
            "read_history": lambda: list(store.read_history("r")),
            "read_history_indexed": lambda: list(read_history_indexed(store, "r")),
            "replay": lambda: replay(store, "r", use_snapshots=False),
            "replay_snap": lambda: replay(store, "r"),
            "replay_to_newest": lambda: replay(store, "r", newest),
            "check_history": lambda: check_history(store, "r"),
            "verify_decisions": lambda: verify_decisions(store, "r"),
            "open": lambda: RolloutController.open(store, "r"),
            "restore": lambda: RolloutController.restore(store, "r", newest),
            "restore_strict": lambda: RolloutController.restore(store, "r", newest, mode="strict"),
        }
        for name, call in calls.items():
            with pytest.raises(CorruptLogError) as info:
                call()
            assert (info.value.offset, info.value.kind) == (victim, "missing"), name
        assert store.get_run("r").current_epoch == 2, "a refused takeover must not raise it"
        # The current history before the abandoned rows is still readable on its own.
        replay(store, "r", branched.resumed_at)
    finally:
        store.close()
    for args in (
        ("replay", url, "--run", "r", "--check"),
        ("replay", url, "--run", "r", "--verify-decisions"),
        ("replay", url, "--run", "r"),
        ("metrics", url, "--run", "r"),
        ("audit", url),
    ):
        code, lines = _cli(*args)
        assert code == 1, (args, lines)
        assert len(lines) == 1, (args, lines)
        assert f"at offset {victim}: missing row" in lines[0], (args, lines[0])
    alive = [t.name for t in threading.enumerate() if t.name.startswith("rolloutlog-log-check")]
    assert alive == []


def test_a_whole_branched_log_passes_every_check(branched: Branched) -> None:
    """No false alarm on an intact log with an abandoned branch."""
    store = EventStore.open(branched.url)
    try:
        assert check_history(store, "r").violation is None
        assert verify_decisions(store, "r").mismatch is None
        replay(store, "r")
        RolloutController.open(store, "r").close()
    finally:
        store.close()
    for args in (("replay", branched.url, "--run", "r", "--check"), ("audit", branched.url)):
        code, lines = _cli(*args)
        assert code == 0, (args, lines)


class _Recording:
    """Delegates to a store and records the ranges ``check_whole`` counts."""

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self.checked: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
        with self._lock:
            self.checked.append((from_seq, upto))
        self._store.check_whole(run_id, upto, from_seq=from_seq)


def test_the_replay_counts_only_the_abandoned_rows_no_snapshot_stands_for(
    branched: Branched,
) -> None:
    """The cost of the check: the snapshot's prefix (counted before this change too) plus
    the abandoned rows after it, each offset once; nothing is read for it."""
    store = EventStore.open(branched.url)
    try:
        rec = _Recording(store)
        result = replay(rec, "r", check_threads=2)  # type: ignore[arg-type]
        snap = result.snapshot_offset
        assert snap is not None and snap <= branched.resumed_at
        abandoned = (branched.resumed_at + 1, branched.first_seq - 1)
        assert sorted(rec.checked) == [*check_ranges(snap, 2), abandoned]
        # Restoring to a checkpoint before the branch counts nothing of it (the salvage
        # scan reads those rows anyway).
        rec.checked.clear()
        replay(rec, "r", branched.resumed_at, check_threads=1)  # type: ignore[arg-type]
        assert all(hi <= branched.resumed_at for _, hi in rec.checked)
    finally:
        store.close()


def test_a_strict_restore_refuses_a_row_missing_after_its_offset(db_url: str) -> None:
    """A strict restore does not read the rows after its offset (a salvage scan does):
    they are counted, so a corrupt log is refused in both modes."""
    store = EventStore.open(db_url)
    try:
        ctl = start(store)
        run(drive(ctl, 3))
        ctl.close()
        cps = [r.seq for r in store.read("r") if r.type == "CheckpointMarked"]
        victim = (cps[1] + cps[2]) // 2
        _sql(db_url, "DELETE FROM events WHERE run_id = 'r' AND seq = :s", s=victim)
        for mode in ("strict", "salvage"):
            with pytest.raises(CorruptLogError) as info:
                RolloutController.restore(store, "r", cps[1], mode=mode)  # type: ignore[arg-type]
            assert (info.value.offset, info.value.kind) == (victim, "missing"), mode
        assert store.get_run("r").current_epoch == 1
    finally:
        store.close()


def test_memory_store_reports_a_row_missing_from_an_abandoned_branch() -> None:
    store = MemoryEventStore()
    resumed_at, first_seq, _ = _branch(store)
    victim = (resumed_at + first_seq) // 2
    events = store._runs["r"].events
    del events[victim - 1]
    for call in (
        lambda: list(store.read_history("r")),
        lambda: replay(store, "r", use_snapshots=False),  # type: ignore[arg-type]
        lambda: RolloutController.open(store, "r"),  # type: ignore[arg-type]
    ):
        with pytest.raises(CorruptLogError) as info:
            call()
        assert (info.value.offset, info.value.kind) == (victim, "missing")
