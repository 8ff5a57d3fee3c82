"""The writer process: appends in a child process, its failures, deadlines and lifetime.

The committer's contract with ``writer="process"`` is checked by the GroupCommitter
suite (test_store_groupcommit.py runs every test both ways); this file covers what only
a child process can do wrong: die, hang, outlive its parent, lose an error's type.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from storetest_helpers import make_batch, skip_if_memory

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import ROLLOUT_INDEXER, attach
from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    GroupCommitClosedError,
    GroupCommitter,
    MemoryEventStore,
    NewEvent,
    RunNotFoundError,
    StoreError,
    StoreUnavailableError,
    WriterProcessError,
)
from rolloutlog.eventstore.writer_process import WriterProcess


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """True once no process ``pid`` exists (reaped or never our child), within a deadline."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def sql_store(db_url: str, open_store):  # open_store: conftest's factory
    skip_if_memory(db_url, "a writer process opens the database itself")
    store = open_store(db_url)
    store.create_run("r1")
    return store


def test_appends_land_with_their_derived_rows(sql_store: EventStore) -> None:
    attach(sql_store)
    now = datetime.now(UTC)
    rows = [NewEvent("X", 1, f'{{"i":{i}}}', now, (i, None, None, 0, 0)) for i in range(50)]
    with WriterProcess(
        str(sql_store.url.render_as_string(hide_password=False)), [ROLLOUT_INDEXER]
    ) as w:
        assert w.append("r1", rows[:20], expected_seq=1, epoch=1) == 20
        assert w.append("r1", rows[20:], expected_seq=21, epoch=1) == 50
    assert [e.payload for e in sql_store.read("r1")] == [r.payload for r in rows]
    keys = sql_store.derived_rows("rollout_index", "r1")
    assert [(k[1], k[3]) for k in keys] == [(i + 1, i) for i in range(50)]


def test_store_errors_arrive_with_their_type_and_fields(sql_store: EventStore) -> None:
    url = sql_store.url.render_as_string(hide_password=False)
    with WriterProcess(url) as w:
        w.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
        with pytest.raises(AppendConflictError) as conflict:
            w.append("r1", make_batch(1, 1), expected_seq=1, epoch=1)
        assert (conflict.value.expected_seq, conflict.value.actual_next_seq) == (1, 3)
        sql_store.open_epoch("r1")  # a takeover in this process fences the child's writes
        with pytest.raises(EpochFencedError) as fenced:
            w.append("r1", make_batch(3, 1), expected_seq=3, epoch=1)
        assert (fenced.value.writer_epoch, fenced.value.current_epoch) == (1, 2)
        with pytest.raises(RunNotFoundError):
            w.append("nope", make_batch(1, 1), expected_seq=1, epoch=1)
        # The child is still serving after refusing: errors are answers, not deaths.
        assert w.append("r1", make_batch(3, 1), expected_seq=3, epoch=2) == 3
    assert sql_store.last_seq("r1") == 3


def test_a_killed_child_fails_the_committer_and_loses_nothing_durable(
    sql_store: EventStore,
) -> None:
    gc = GroupCommitter(sql_store, "r1", epoch=1, next_seq=1, window_s=0.0, writer="process")
    try:
        gc.submit(make_batch(1, 5))
        assert gc.flush(timeout=30) == 5
        assert gc._process is not None and gc._process.pid is not None
        pid = gc._process.pid
        os.killpg(pid, signal.SIGKILL)
        assert _gone(pid) or os.waitpid(pid, os.WNOHANG)  # dead (perhaps not yet reaped)
        gc.submit(make_batch(6, 3))
        with pytest.raises(GroupCommitClosedError, match="writer process") as failed:
            gc.flush(timeout=30)
        assert isinstance(failed.value.__cause__, WriterProcessError)
        assert "died while appending" in str(failed.value.__cause__)
        with pytest.raises(GroupCommitClosedError):
            gc.submit(make_batch(9, 1))  # later events would depend on lost ones
    finally:
        started = time.monotonic()
        gc.close(flush=False)
        assert time.monotonic() - started < 15
    assert sql_store.last_seq("r1") == 5  # the durable events, and nothing else


def test_a_child_that_stops_answering_is_killed_at_the_reply_deadline(
    sql_store: EventStore,
) -> None:
    w = WriterProcess(sql_store.url.render_as_string(hide_password=False), reply_timeout_s=1.0)
    pid = w.pid
    assert pid is not None
    try:
        os.killpg(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WriterProcessError, match=r"did not answer within 1s"):
            w.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
        assert time.monotonic() - started < 10
        assert w.pid is None and _gone(pid)
        with pytest.raises(WriterProcessError, match="closed"):
            w.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    finally:
        w.kill()


def test_the_child_exits_when_its_parent_dies(sql_store: EventStore, tmp_path: Path) -> None:
    url = sql_store.url.render_as_string(hide_password=False)
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from rolloutlog.eventstore.writer_process import WriterProcess
            w = WriterProcess({url!r})
            print(w.pid, flush=True)
            time.sleep(120)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), line
        child = int(line)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        # Its own session: the parent's group kill did not reach it; its pipe closing did.
        assert _gone(child, within_s=15), f"writer process {child} outlived its parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=10)


def test_a_child_that_cannot_open_the_database_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "log.db"
    with pytest.raises(StoreUnavailableError):
        WriterProcess(f"sqlite:///{missing}")


def test_a_writer_process_is_refused_where_no_other_process_can_write(
    tmp_path: Path,
) -> None:
    with pytest.raises(StoreError, match="in-memory store"):
        GroupCommitter(MemoryEventStore(), "r1", epoch=1, next_seq=1, writer="process")
    path = tmp_path / "log.db"
    EventStore.open(f"sqlite:///{path}").close()
    with EventStore.open(f"sqlite:///{path}", readonly=True) as readonly:
        with pytest.raises(StoreError, match="read-only"):
            GroupCommitter(readonly, "r1", epoch=1, next_seq=1, writer="process")
    with pytest.raises(ValueError, match="'thread' or 'process'"):
        GroupCommitter(MemoryEventStore(), "r1", epoch=1, next_seq=1, writer="fork")  # type: ignore[arg-type]


def test_a_controller_with_a_writer_process_replays_to_its_own_state(
    sql_store: EventStore,
) -> None:
    from rolloutlog.controller.domain import commands

    ctl = RolloutController.start(
        sql_store,
        "run-w",
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1),
        dataset_fingerprint="toy",
        dataset_size=64,
        store_config=StoreConfig(commit_writer="process", snapshot_interval=0),
    )
    try:
        assert ctl.committer.writer == "process"
        ctl.execute(commands.AdmitStep())
        ctl.flush()
        state = ctl.state
    finally:
        ctl.close()
    reopened = RolloutController.open(sql_store, "run-w", store_config=StoreConfig())
    try:
        assert reopened.state.groups.keys() == state.groups.keys()
        assert reopened.state.last_seq >= state.last_seq
    finally:
        reopened.close()
