"""The writer process: commands streamed to a child that appends them; its failures,
deadlines, lifetime and wire format.

The committer's contract with ``writer="process"`` is checked by the GroupCommitter
suite (test_store_groupcommit.py runs every test both ways); this file covers what only
a child process can do wrong: die, hang, outlive its parent, lose an error's type, store
a value other than the one a thread would have stored, block the submitting thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from storetest_helpers import make_batch, make_event, skip_if_memory

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import attach
from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    GroupCommitClosedError,
    MemoryEventStore,
    NewEvent,
    RunNotFoundError,
    StoreError,
    StoreUnavailableError,
    WriterProcessError,
    open_committer,
)
from rolloutlog.eventstore.writer_process import ProcessCommitter, _parse_frames, _unit_frame


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


@pytest.fixture
def committers():
    """Factory of process committers, each closed (without flushing) at teardown."""
    made: list[ProcessCommitter] = []

    def _make(store: EventStore, run_id: str = "r1", **kw: object) -> ProcessCommitter:
        kw.setdefault("epoch", 1)
        if "next_seq" not in kw:
            kw["next_seq"] = store.last_seq(run_id) + 1
        gc = ProcessCommitter(store, run_id, **kw)  # type: ignore[arg-type]
        made.append(gc)
        return gc

    yield _make
    for gc in made:
        pid = gc.pid
        gc.close(flush=False)
        if pid is not None:
            assert _gone(pid), f"writer process {pid} outlived its committer"


def test_appends_land_with_their_derived_rows(sql_store: EventStore, committers) -> None:
    attach(sql_store)
    now = datetime.now(UTC)
    rows = [NewEvent("X", 1, f'{{"i":{i}}}', now, (i, None, None, 0, 0)) for i in range(50)]
    gc = committers(sql_store, window_s=0.0)
    assert gc.submit(rows[:20]) == 20
    assert gc.submit(rows[20:]) == 50
    assert gc.flush(timeout=60) == 50
    assert [e.payload for e in sql_store.read("r1")] == [r.payload for r in rows]
    keys = sql_store.derived_rows("rollout_index", "r1")
    assert [(k[1], k[3]) for k in keys] == [(i + 1, i) for i in range(50)]
    assert len(gc.commit_seconds) >= 1 and all(s >= 0 for s in gc.commit_seconds)


def test_store_errors_arrive_with_their_type_and_fields(sql_store: EventStore, committers):
    sql_store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    conflicting = committers(sql_store, next_seq=1)  # offsets 1.. are taken
    conflicting.submit(make_batch(1, 1))
    with pytest.raises(GroupCommitClosedError) as conflict:
        conflicting.flush(timeout=60)
    cause = conflict.value.__cause__
    assert isinstance(cause, AppendConflictError)
    assert (cause.expected_seq, cause.actual_next_seq) == (1, 3)

    fenced = committers(sql_store)
    fenced.submit(make_batch(3, 1))
    assert fenced.flush(timeout=60) == 3
    sql_store.open_epoch("r1")  # a takeover in this process fences the child's writes
    fenced.submit(make_batch(4, 1))
    with pytest.raises(GroupCommitClosedError) as info:
        fenced.flush(timeout=60)
    assert isinstance(info.value.__cause__, EpochFencedError)
    assert (info.value.__cause__.writer_epoch, info.value.__cause__.current_epoch) == (1, 2)

    missing = committers(sql_store, run_id="nope", next_seq=1)
    missing.submit(make_batch(1, 1))
    with pytest.raises(GroupCommitClosedError) as nope:
        missing.flush(timeout=60)
    assert isinstance(nope.value.__cause__, RunNotFoundError)
    assert sql_store.last_seq("r1") == 3


def test_a_failed_append_drops_every_later_command(sql_store: EventStore, committers) -> None:
    """Commands queued behind a failed one are never committed: they depend on it."""
    gc = committers(sql_store, window_s=30.0)
    gc.submit(make_batch(1, 2))
    sql_store.append("r1", make_batch(100, 1), expected_seq=1, epoch=1)  # takes offset 1
    gc.submit(make_batch(3, 2))
    with pytest.raises(GroupCommitClosedError):
        gc.flush(timeout=60)
    with pytest.raises(GroupCommitClosedError, match="failed earlier"):
        gc.submit(make_batch(5, 1))
    gc.close()
    assert [e.payload for e in sql_store.read("r1")] == [make_event(100).payload]


def test_a_killed_child_fails_the_committer_and_loses_nothing_durable(
    sql_store: EventStore, committers
) -> None:
    gc = committers(sql_store, window_s=30.0)
    gc.submit(make_batch(1, 5))
    assert gc.flush(timeout=60) == 5
    pid = gc.pid
    assert pid is not None
    gc.submit(make_batch(6, 3))
    os.killpg(pid, signal.SIGKILL)
    with pytest.raises(GroupCommitClosedError, match="writer process") as failed:
        gc.flush(timeout=30)
    assert isinstance(failed.value.__cause__, WriterProcessError)
    assert "died before offset 8 was durable (exit code -9)" in str(failed.value.__cause__)
    with pytest.raises(GroupCommitClosedError):
        gc.submit(make_batch(9, 1))  # later events would depend on lost ones
    assert _gone(pid)
    started = time.monotonic()
    gc.close(flush=False)
    assert time.monotonic() - started < 15
    # The window (30 s, unless a flush) kept the child from committing 6..8 before it died.
    assert sql_store.last_seq("r1") == 5  # the durable events, and nothing else


def test_a_child_that_dies_idle_fails_the_next_submit(sql_store: EventStore, committers):
    gc = committers(sql_store, window_s=0.0)
    gc.submit(make_batch(1, 2))
    assert gc.flush(timeout=60) == 2
    pid = gc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            gc.submit(make_batch(3, 1))
        except GroupCommitClosedError as exc:
            assert isinstance(exc.__cause__, WriterProcessError)
            assert "died" in str(exc.__cause__)
            break
    else:
        raise AssertionError("a dead writer process went unnoticed for 30 s")
    assert sql_store.last_seq("r1") == 2


def test_a_child_that_stops_answering_is_killed_at_the_reply_deadline(
    sql_store: EventStore, committers
) -> None:
    gc = committers(sql_store, window_s=0.0, reply_timeout_s=1.0)
    gc.submit(make_batch(1, 1))
    assert gc.flush(timeout=60) == 1  # started and answering
    pid = gc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)
    gc.submit(make_batch(2, 2))
    started = time.monotonic()
    with pytest.raises(GroupCommitClosedError) as info:
        gc.flush()  # no timeout of its own: the reply deadline bounds it
    assert time.monotonic() - started < 10
    assert isinstance(info.value.__cause__, WriterProcessError)
    assert "did not answer within 1s" in str(info.value.__cause__)
    assert gc.pid is None and _gone(pid)
    assert sql_store.last_seq("r1") == 1


def test_an_aflush_is_bounded_by_the_reply_deadline(sql_store: EventStore, committers) -> None:
    gc = committers(sql_store, window_s=0.0, reply_timeout_s=1.0)
    gc.submit(make_batch(1, 1))
    assert gc.flush(timeout=60) == 1
    pid = gc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)

    async def main() -> BaseException:
        gc.submit(make_batch(2, 1))
        try:
            await asyncio.wait_for(gc.aflush(), timeout=30)
        except GroupCommitClosedError as exc:
            return exc
        raise AssertionError("aflush returned for a stopped writer process")

    err = asyncio.run(main())
    assert isinstance(err.__cause__, WriterProcessError)
    assert _gone(pid)


def test_a_child_that_never_starts_is_killed_at_the_start_deadline(
    sql_store: EventStore, committers
) -> None:
    gc = committers(sql_store, start_timeout_s=1.0)
    pid = gc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)  # most likely before it opened the database
    gc.submit(make_batch(1, 1))
    with pytest.raises(GroupCommitClosedError) as info:
        gc.flush(timeout=30)
    # Stopped before or after it opened the database: one of the two deadlines fired.
    assert "did not open the database within 1s" in str(info.value) or (
        "did not answer" in str(info.value)
    )
    assert _gone(pid)


def test_aflush_waits_on_the_event_loop_without_blocking_it(
    sql_store: EventStore, committers
) -> None:
    gc = committers(sql_store, window_s=0.0)
    gc.submit(make_batch(1, 1))
    assert gc.flush(timeout=60) == 1
    pid = gc.pid
    assert pid is not None

    async def main() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        os.killpg(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.5, os.killpg, pid, signal.SIGCONT)
        gc.submit(make_batch(2, 3))
        durable = await asyncio.wait_for(gc.aflush(), timeout=30)
        task.cancel()
        return durable, ticks

    durable, ticks = asyncio.run(main())
    assert durable == 4
    assert ticks >= 10, f"the event loop ran only {ticks} ticks while aflush waited 0.5 s"
    assert sql_store.last_seq("r1") == 4


def test_submit_never_blocks_on_a_full_pipe(sql_store: EventStore, committers) -> None:
    """A child that has stopped reading: the pipe fills, ``submit`` keeps the bytes and
    returns at once; the child catches up after, in order, nothing lost."""
    gc = committers(sql_store, window_s=0.0)
    gc.submit(make_batch(1, 1))
    assert gc.flush(timeout=60) == 1
    pid = gc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)
    try:
        big = "x" * 4000
        started = time.monotonic()
        n = 2
        for _ in range(800):  # ~3.2 MB: more than the pipe holds
            gc.submit([make_event(n, payload=f'{{"i": {n}, "pad": "{big}"}}')])
            n += 1
        assert time.monotonic() - started < 10
        assert len(gc._out) > 0, "the pipe took everything: the test did not fill it"
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert gc.flush(timeout=120) == n - 1
    assert [e.seq for e in sql_store.read("r1")] == list(range(1, n))


def test_close_without_flush_commits_what_was_sent(sql_store: EventStore, committers) -> None:
    gc = committers(sql_store, window_s=30.0)
    gc.submit(make_batch(1, 3))
    gc.submit(make_batch(4, 2))
    pid = gc.pid
    gc.close(flush=False)
    assert sql_store.last_seq("r1") == 5
    assert gc.durable_seq == 5
    assert pid is not None and _gone(pid)
    with pytest.raises(GroupCommitClosedError, match="closed"):
        gc.submit(make_batch(6, 1))


def test_the_child_exits_when_its_parent_dies_and_commits_only_whole_commands(
    sql_store: EventStore, tmp_path: Path
) -> None:
    """The parent is SIGKILLed while submitting 3-event commands: the child commits the
    whole commands it read, never part of one, and exits."""
    url = sql_store.url.render_as_string(hide_password=False)
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from storetest_helpers import make_batch
            from rolloutlog.eventstore import EventStore
            from rolloutlog.eventstore.writer_process import ProcessCommitter
            store = EventStore.open({url!r})
            gc = ProcessCommitter(store, "r1", epoch=1, next_seq=1, window_s=0.0)
            gc.submit(make_batch(1, 3))
            gc.flush(timeout=60)
            print(gc.pid, flush=True)
            n = 4
            while True:
                gc.submit(make_batch(n, 3))
                n += 3
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
        time.sleep(0.5)  # mid-stream
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        # Its own session: the parent's group kill did not reach it; its pipe closing did.
        assert _gone(child, within_s=30), f"writer process {child} outlived its parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=10)
    last = sql_store.last_seq("r1")
    assert last >= 3 and last % 3 == 0, f"a command was torn: {last} events stored"
    got = list(sql_store.read("r1"))
    assert [e.payload for e in got] == [e.payload for e in make_batch(1, last)]


def test_a_child_that_cannot_open_the_database_says_why(tmp_path: Path, committers) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    store = EventStore.open(f"sqlite:///{folder / 'log.db'}")
    try:
        store.create_run("r1")
        folder.rename(tmp_path / "moved")  # this process's pooled connection keeps the file
        gc = committers(store)
        gc.submit(make_batch(1, 1))
        with pytest.raises(GroupCommitClosedError) as info:
            gc.flush(timeout=60)
        assert isinstance(info.value.__cause__, StoreUnavailableError)
        assert "does not exist" in str(info.value.__cause__)
    finally:
        store.close()


def test_a_writer_process_is_refused_where_no_other_process_can_write(
    tmp_path: Path,
) -> None:
    with pytest.raises(StoreError, match="in-memory store"):
        open_committer(MemoryEventStore(), "r1", writer="process", epoch=1, next_seq=1)
    path = tmp_path / "log.db"
    EventStore.open(f"sqlite:///{path}").close()
    with EventStore.open(f"sqlite:///{path}", readonly=True) as readonly:
        with pytest.raises(StoreError, match="read-only"):
            open_committer(readonly, "r1", writer="process", epoch=1, next_seq=1)
        # auto: the committer's thread where no process can write.
        auto = open_committer(readonly, "r1", writer="auto", epoch=1, next_seq=1)
        assert auto.writer == "thread"
        auto.close()
    memory = open_committer(MemoryEventStore(), "r1", writer="auto", epoch=1, next_seq=1)
    assert memory.writer == "thread"
    memory.close()
    with pytest.raises(ValueError, match="'auto', 'thread' or 'process'"):
        open_committer(MemoryEventStore(), "r1", writer="fork", epoch=1, next_seq=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "stamp",
    [
        datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 11, 30, 14, 0, 0, 999999, tzinfo=timezone(timedelta(hours=2))),
        datetime(2026, 11, 30, 12, 0, 0, 1),  # naive: goes as the object itself
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # before the epoch
        datetime(2262, 4, 12, 0, 0, 0, 1, tzinfo=UTC),  # past float microseconds' range
    ],
    ids=["utc", "plus2h", "naive", "before-epoch", "year-2262"],
)
def test_a_writer_process_stores_exactly_what_the_thread_stores(
    db_url: str, open_store, stamp: datetime
) -> None:
    """The wire format (marshal with microseconds, or pickle) changes no stored value."""
    skip_if_memory(db_url, "a writer process opens the database itself")
    stores = {}
    for writer in ("thread", "process"):
        store = open_store(db_url)
        run = f"r-{writer}"
        store.create_run(run)
        batch = [
            NewEvent("A", 1, '{"a": "é✓"}', stamp, None),
            NewEvent("B", 2, '{"b": 1}', stamp + timedelta(microseconds=1), None),
        ]
        gc = open_committer(store, run, writer=writer, epoch=1, next_seq=1)
        gc.submit(batch)
        assert gc.flush(timeout=60) == 2
        gc.close()
        stores[writer] = [
            (e.type, e.schema_version, e.payload, e.recorded_at) for e in store.read(run)
        ]
    assert stores["process"] == stores["thread"]


def test_commands_go_as_marshal_unless_a_value_needs_pickle() -> None:
    now = datetime(2026, 11, 30, tzinfo=UTC)
    plain = _unit_frame([NewEvent("A", 1, "{}", now, (1, None, "x", 2.5))], [])
    assert plain[8:9] == b"m"
    naive = _unit_frame([NewEvent("A", 1, "{}", now.replace(tzinfo=None), None)], [])
    assert naive[8:9] == b"p"
    odd_key = _unit_frame([NewEvent("A", 1, "{}", now, (Decimal("1.5"),))], [])
    assert odd_key[8:9] == b"p"
    # Whole frames only: a torn frame stays in the buffer.
    buf = bytearray(plain + naive[:-3])
    assert [m[0] for m in _parse_frames(buf)] == ["u"]
    assert bytes(buf) == naive[:-3]
    buf += naive[-3:]
    (message,) = _parse_frames(buf)
    assert message[0] == "U" and message[1][0][3] == now.replace(tzinfo=None)
    assert not buf


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
        store_config=StoreConfig(snapshot_interval=0, commit_writer="process"),
    )
    try:
        committer = ctl.committer
        assert isinstance(committer, ProcessCommitter)
        # The lifecycle: started in the background, healthy once it opened the database.
        committer.wait_started(timeout=60)
        health = committer.health()
        assert health.started and health.alive and health.error is None
        assert health.pid is not None and os.getpgid(health.pid) == health.pid
        ctl.execute(commands.AdmitStep())
        ctl.flush()
        state = ctl.state
    finally:
        ctl.close()
    stopped = committer.health()
    assert stopped.pid is None and not stopped.alive and stopped.error is None
    reopened = RolloutController.open(sql_store, "run-w", store_config=StoreConfig())
    try:
        assert reopened.state.groups.keys() == state.groups.keys()
        assert reopened.state.last_seq >= state.last_seq
    finally:
        reopened.close()


def test_the_child_reads_a_command_larger_than_its_buffer_limit() -> None:
    """The child caps what it holds unparsed, but never below the next whole frame."""
    from rolloutlog.eventstore.writer_process import _Child

    commands_r, commands_w = os.pipe()
    control_r, control_w = os.pipe()
    try:
        for fd in (commands_r, control_r):
            os.set_blocking(fd, False)
        child = _Child(commands_r, control_r, answers=-1, buffer_limit=100)
        now = datetime(2026, 11, 30, tzinfo=UTC)
        big = [NewEvent("A", 1, '{"pad": "' + "x" * 300_000 + '"}', now, None)]
        data = _unit_frame(big, []) + _unit_frame(big[:1], [])
        threading.Thread(target=os.write, args=(commands_w, data), daemon=True).start()
        deadline = time.monotonic() + 30
        batch: list[NewEvent] = []
        while len(batch) < 2 and time.monotonic() < deadline:
            child.read()
            if child.pending():
                batch += child.take_batch(max_batch=1)[0]  # one command per batch
            time.sleep(0.001)
        assert [e.payload for e in batch] == [big[0].payload] * 2
        assert not child.buf and child.carry is None
    finally:
        for fd in (commands_r, commands_w, control_r, control_w):
            os.close(fd)


def test_the_thread_is_the_default_writer_even_on_a_database(sql_store: EventStore) -> None:
    """A writer process is an opt-in: a plain open starts no child process."""
    assert StoreConfig().commit_writer == "thread"
    committer = open_committer(sql_store, "r1", epoch=1, next_seq=1)
    try:
        assert committer.writer == "thread"
    finally:
        committer.close()


def test_the_writer_process_is_refused_off_its_platforms(
    sql_store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(WriterProcessError, match="runs on linux, darwin, not win32"):
        ProcessCommitter(sql_store, "r1", epoch=1, next_seq=1)


def test_importing_the_writer_process_needs_no_fcntl() -> None:
    """fcntl is POSIX-only and used on Linux alone: the module imports without it."""
    code = "import sys; sys.modules['fcntl'] = None; import rolloutlog.eventstore.writer_process"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
